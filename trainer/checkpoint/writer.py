"""A node's checkpoint writes, seen from the training process.

At the step boundary the state is copied into a shared-memory host buffer, the only pause
training sees; the writer process (`writer_process.py`) then writes the node-local snapshot
and, on rank 0, stages and uploads the durable checkpoint, outside this process's GIL.
The host buffer is refilled only after the writer has read it: a save waits for that for
at most `checkpoint.save_wait_s`, else it is skipped (one line, a metric), and so are the
saves after it, at once, until the writer has taken it. It never waits
for an upload: a checkpoint staged while an earlier one uploads waits in the writer, where
a newer one replaces it (latest wins). Only the run's end and a stop wait for the upload,
within their budgets. A write that keeps failing is reported loudly and training goes on,
since the previous checkpoint is still intact. With `async_save=false` the same work runs
inline.

The writer is watched (`WriterWatch`): it reports its progress (phase, bytes, attempt), and
one that stays silent past its limit while it has work is named in one line, killed, its
open multipart uploads aborted, and replaced by a new writer, which stages again what the
old one had not taken and publishes the newest checkpoint it had staged.

Waiting is on Events, not `Thread.join`: in Python 3.11 a signal handler that raises while
the main thread is in `join()` can leave the thread marked stopped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

from trainer.checkpoint.manager import Checkpointer
from trainer.checkpoint.shared_state import SharedState, SharedStateBuffer
from trainer.checkpoint.snapshots import SnapshotDir
from trainer.checkpoint.writer_process import Republish, WriterSetup
from trainer.checkpoint.writer_start import WriterHandle, spawn_writer
from trainer.checkpoint.writer_watch import WATCH_POLL_S, WriterWatch, abort_uploads, doing
from trainer.checkpoint.writing import (
    AttemptFailed,
    Coalesced,
    Event,
    Progress,
    Published,
    PublishFailed,
    SaveRequest,
    SaveWork,
    Staged,
)
from trainer.config import CheckpointConfig
from trainer.telemetry.checkpoint_stats import CheckpointStats
from trainer.telemetry.log import event


class CheckpointWriter:
    """Saves of one node: snapshots (every node's first rank) and durable checkpoints (rank 0)."""

    def __init__(
        self,
        durable: Checkpointer | None,
        config: CheckpointConfig,
        logger: logging.Logger,
        *,
        cache: Path,
        snapshots: bool = False,
        process: WriterHandle | None = None,
    ) -> None:
        """`durable` is rank 0's store (None elsewhere); `cache` the location's node-local
        folder; `snapshots` whether this rank may keep snapshots. `config.async_save` chooses
        the writer process over inline writes: `process` if one was spawned early (see
        `spawn_writer`), else one started here; a rank that writes neither has none."""
        self.durable, self.config, self.attempts, self.log = durable, config, config.attempts, logger
        self.cache = cache
        self.snapshots: SnapshotDir | None = None
        self.stats = CheckpointStats()
        fixed = config.writer_timeout_s
        self.watch = WriterWatch(config.writer_floor_s, None if fixed == "auto" else float(fixed))
        self._staged = threading.Event()
        self._durable_idle = threading.Event()
        self._staged.set()
        self._durable_idle.set()
        self._lock = threading.RLock()  # the books below, kept by the listener and the watch
        self._handed: tuple[SaveRequest, SharedState] | None = None  # sent, not yet staged
        self._durable: dict[int, SaveRequest] = {}  # durable saves handed over, not yet ended
        self._staged_durable: dict[int, str] = {}  # their staged folders, until published
        self._last_progress: Progress | None = None
        self._stalls: dict[int, float] = {}
        self._buffer: SharedStateBuffer | None = None
        self._setup: WriterSetup | None = None
        self._process: WriterHandle | None = None
        self._inline: SaveWork | None = None
        self._snapshot_failing = False
        self._skipped = 0  # saves skipped in a row, the writer not having taken the state before
        self._closing = threading.Event()
        if config.async_save and (durable is not None or snapshots):
            self._process = process or spawn_writer()
        elif process is not None:
            process.stdin.close()

    def start(self, snapshots: SnapshotDir | None) -> None:
        """Begin writing: durable checkpoints if this rank has a store, snapshots if given."""
        self.snapshots = snapshots
        if self._process is not None and self.durable is None and snapshots is None:
            self._process.stdin.close()  # nothing to write on this rank after all
            self._process = None
        if self._process is None:
            self._write_inline()
            return
        self._setup = WriterSetup(
            durable=None if self.durable is None else self.config,
            cache=self.cache,
            snapshots=snapshots,
            attempts=self.attempts,
            fence=None if self.durable is None else self.durable.fence,
        )
        self._buffer = SharedStateBuffer()
        self.watch.expect_start(time.monotonic())
        self._begin(self._process)
        threading.Thread(target=self._watch_loop, name="checkpoint-writer-watch", daemon=True).start()

    def _begin(self, process: WriterHandle) -> None:
        """Set a writer up and listen to it."""
        self._send(process, self._setup)
        threading.Thread(target=self._listen, args=(process,), name="checkpoint-events", daemon=True).start()

    def save(
        self,
        state: dict[str, Any],
        *,
        step: int,
        epoch: int,
        world_size: int,
        durable: bool,
        wait_s: float | None = None,
        patient: bool = True,
    ) -> bool:
        """Copy `state` now and hand it to the writer: a snapshot if this node keeps them,
        the durable checkpoint if `durable`. The copy waits for the writer to have taken the
        state before, for at most `wait_s` (None: as long as it takes); past that the save
        is skipped (one line). While saves are being skipped, one that is not `patient` (a
        regular save; the run's end and a stop are) is skipped at once."""
        durable = durable and self.durable is not None
        started = time.perf_counter()
        ready = self._staged.wait(0 if self._skipped and not patient else wait_s)
        self.stats.wait_seconds_total += time.perf_counter() - started
        if not ready:  # the first of a streak waited its bound; the rest see at once
            self.stats.skipped_total += 1
            self._skipped += 1
            if self._skipped == 1:
                handed = self._handed[0].step if self._handed else None
                self.log.warning(
                    "checkpoint step %d skipped: the writer has not taken step %s's state after %.1fs; "
                    "saves are skipped until it does (the newest durable step is %s)",
                    step, handed, wait_s, self.stats.last_success_step,
                )  # fmt: skip
            return False
        if self._skipped:
            self.log.info("checkpoint step %d handed over again: %d saves were skipped", step, self._skipped)
            self._skipped = 0
        request = SaveRequest(
            step, epoch, world_size, self.snapshots is not None, durable, frozenset(self._protected())
        )
        if self._inline is not None:
            staged = self._inline.stage(state, request)
            self.stats.last_stall_seconds = self._stalls[step] = time.perf_counter() - started
            if staged is not None:
                self._inline.publish(staged, request)
            return True
        try:
            shared = self._buffer.fill(state)
        except OSError as error:
            self.log.error("checkpoint step %d NOT saved: no shared memory for its copy (%s)", step, error)
            self.stats.failures_total += durable
            return False
        self.stats.last_stall_seconds = self._stalls[step] = time.perf_counter() - started
        with self._lock:
            self._staged.clear()
            self._handed = (request, shared)
            if durable:
                self._durable[step] = request
                self._durable_idle.clear()
            self.watch.handed(time.monotonic())
            process = self._process
        if process is not None:
            self._send(process, (request, shared))
        return True

    def _protected(self) -> set[int]:
        return set() if self.durable is None else self.durable.protected

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every write handed over has finished; False if `timeout` ran out."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for done in (self._staged, self._durable_idle):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not done.wait(left):
                return False
        return True

    @property
    def busy(self) -> bool:
        """An earlier save is still being staged or published."""
        return not (self._staged.is_set() and self._durable_idle.is_set())

    def wait_staged(self, timeout: float) -> bool:
        """Block until the last save handed over is staged (its snapshot, if any, written)."""
        return self._staged.wait(timeout)

    def close(self, timeout: float) -> None:
        """Let the last write finish, for up to `timeout` seconds, and let the writer go."""
        if not self.wait(timeout):
            self.log.error("checkpoint write still running after %.0fs; exiting without it", timeout)
        self._closing.set()
        # let go of the writer before closing its stdin: it exits at once, and the listener
        # must not take an exit it sees while `_process` still names it for a death
        with self._lock:
            process, self._process = self._process, None
        if process is not None:
            process.stdin.close()  # the writer finishes what it holds and exits
        if self._buffer is not None:
            self._buffer.close()

    def _write_inline(self) -> None:
        """From now on, saves run in this process (`async_save=false`, or the writer died)."""
        snapshot_store = self.snapshots.checkpointer() if self.snapshots is not None else None
        self._inline = SaveWork(self.durable, snapshot_store, self.attempts, self._on_event)

    def _send(self, process: WriterHandle, message: object) -> None:
        try:
            pickle.dump(message, process.stdin)
            process.stdin.flush()
        except OSError:  # the writer died: `_listen` reports it and switches to inline writes
            pass

    def _listen(self, process: WriterHandle) -> None:
        """Turn the writer process's events into stats and log lines until it exits."""
        while True:
            try:
                self._on_event(pickle.load(process.stdout))
            except (EOFError, OSError, pickle.UnpicklingError):
                break
        with self._lock:
            died = self._process is process  # not let go by `close`, nor replaced
            if died:
                self._process = None
        if died:
            code = process.wait()
            self.log.error(
                "the checkpoint writer process exited (code %s); writing checkpoints inline from now on", code
            )
            self._write_inline()
            for step in list(self._durable):
                self._on_event(PublishFailed(step, 0))
            self._handed = None
            self._staged.set()

    # ----- the writer's watch --------------------------------------------------------------

    def _watch_loop(self) -> None:
        """Replace a writer that has work and is stuck (silent, or alive with no progress)."""
        while not self._closing.wait(WATCH_POLL_S):
            with self._lock:
                verdict = self.watch.stuck(time.monotonic())
                process = self._process
            if process is not None and verdict is not None:
                self._replace(process, *verdict)

    def _replace(self, process: WriterHandle, how: str, for_s: float, limit_s: float) -> None:
        """Name the stuck writer, stop it for good, abort its open uploads, and hand its
        work to a new one: the state it had not taken, and the newest checkpoint it staged."""
        last = self._last_progress
        handed = self._handed[0].step if self._handed else None
        step = max(self._durable, default=handed) if last is None else last.step
        self.log.error(
            "checkpoint writer stuck on step %s%s: %s for %.0fs (limit %.0fs); replacing it",
            step, doing(last), how, for_s, limit_s,
            extra={"event": "writer_stuck", "fields": {"step": step, "stuck_s": round(for_s, 1),
                                                       "limit_s": round(limit_s, 1), "how": how}},
        )  # fmt: skip
        with self._lock:
            self._process = None  # its end is no death now
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)  # a ForkedWriter's and a Popen's alike
        process.wait()
        abort_uploads(self.durable and self.durable.store, list(self._durable), self.log)
        with self._lock:
            self.stats.writer_replacements_total += 1
            newest = max(self._staged_durable, default=None)
            keep = {newest, *(() if self._handed is None else (self._handed[0].step,))}
            for older in [step for step in self._durable if step not in keep]:  # latest wins
                self._end_durable(older)
                self.stats.coalesced_total += 1
            replacement = spawn_writer()
            self._process = replacement
            self.watch.expect_start(time.monotonic())
        self._begin(replacement)
        if newest is not None:  # its folder stays until the step is over, should this one stick too
            self._send(replacement, Republish(self._durable[newest], Path(self._staged_durable[newest])))
        if self._handed is not None:  # its file's name is gone: the state goes in a new one
            request, shared = self._handed
            self._handed = (request, self._buffer.rehome(shared))
            self._send(replacement, self._handed)

    # ----- events -------------------------------------------------------------------------

    def _on_event(self, happened: Event) -> None:
        with self._lock:
            progress = happened if isinstance(happened, Progress) else None
            if progress is not None and progress.phase != "ready":
                self._last_progress = progress
            self.watch.heard(time.monotonic(), progress, still_working=True)
        if isinstance(happened, Staged):
            self._on_staged(happened)
        elif isinstance(happened, AttemptFailed):
            self.log.warning(
                "checkpoint step %d attempt %d/%d failed: %s",
                happened.step, happened.attempt, happened.attempts, happened.error,
            )  # fmt: skip
        elif isinstance(happened, Coalesced):
            self.stats.coalesced_total += 1
            self.log.info(
                "checkpoint step %d not written: step %d replaced it while an upload ran (latest wins)",
                happened.step, happened.by,
            )  # fmt: skip
            self._end_durable(happened.step)
        elif isinstance(happened, Published):
            self._on_published(happened)
        elif isinstance(happened, PublishFailed):
            self.stats.failures_total += 1
            self._stalls.pop(happened.step, None)
            self.log.error(
                "CHECKPOINT FAILED: step %d was not saved after %d attempts; the newest checkpoint is "
                "still step %s",
                happened.step, happened.attempts, self.stats.last_success_step,
            )  # fmt: skip
            self._end_durable(happened.step)
        with self._lock:
            self.watch.working = self.busy

    def _on_published(self, happened: Published) -> None:
        stats = self.stats
        stats.saves_total += 1
        stats.last_success_step, stats.last_success_timestamp = happened.step, time.time()
        stats.last_bytes, stats.last_write_seconds = happened.size_bytes, happened.seconds
        stall = self._stalls.pop(happened.step, 0.0)
        event(
            self.log,
            "checkpoint",
            f"checkpoint step {happened.step} -> {happened.location} ({happened.size_bytes / 1e6:.1f} MB, "
            f"paused training {stall:.3f}s, written in {happened.seconds:.2f}s)",
            step=happened.step,
            location=happened.location,
            bytes=happened.size_bytes,
            write_seconds=round(happened.seconds, 4),
            stall_seconds=round(stall, 4),
        )
        self._end_durable(happened.step)

    def _end_durable(self, step: int) -> None:
        """A durable save is over (published, failed or replaced); a folder a replaced writer
        staged for it goes too (a writer's own publish consumes what it staged)."""
        with self._lock:
            self._durable.pop(step, None)
            staged = self._staged_durable.pop(step, None)
            if not self._durable:
                self._durable_idle.set()
        if staged:
            shutil.rmtree(staged, ignore_errors=True)

    def _on_staged(self, staged: Staged) -> None:
        stats = self.stats
        if staged.snapshot_error:
            if not self._snapshot_failing:  # once per streak, not every few steps
                self.log.warning(
                    "snapshot step %d failed: %s; the newest snapshot is step %s",
                    staged.step, staged.snapshot_error, stats.last_snapshot_step,
                )  # fmt: skip
            self._snapshot_failing = True
            stats.snapshot_failures_total += 1
        elif staged.snapshot_bytes:
            if self._snapshot_failing:
                self.log.info("snapshots are written again from step %d", staged.step)
            self._snapshot_failing = False
            stats.snapshots_total += 1
            stats.last_snapshot_step = staged.step
            stats.last_snapshot_bytes = staged.snapshot_bytes
            stats.last_snapshot_seconds = staged.snapshot_seconds
        with self._lock:
            if staged.durable and staged.step in self._durable:
                self._staged_durable[staged.step] = staged.durable
            if self._handed is not None and self._handed[0].step == staged.step:
                self._handed = None
            if staged.step not in self._durable:
                self._stalls.pop(staged.step, None)
            self._staged.set()
