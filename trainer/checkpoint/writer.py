"""A node's checkpoint writes, seen from the training process.

At the step boundary the state is copied into a shared-memory host buffer, the only pause
training sees; the writer process (`writer_process.py`) then writes the node-local snapshot
and, on rank 0, stages and uploads the durable checkpoint, outside this process's GIL.
The host buffer is refilled only after the writer has read it, and one durable write is in
flight at most: a save waits for them for a bounded time (its peers wait in a collective
meanwhile), and so does the end of the run. A write that keeps failing is reported loudly
and training goes on, since the previous checkpoint is still intact. With
`async_save=false` the same work runs inline.

Waiting is on Events, not `Thread.join`: in Python 3.11 a signal handler that raises while
the main thread is in `join()` can leave the thread marked stopped.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.checkpoint.manager import Checkpointer
from trainer.checkpoint.shared_state import SharedStateBuffer
from trainer.checkpoint.snapshots import SnapshotDir
from trainer.checkpoint.writer_process import WriterSetup
from trainer.checkpoint.writer_start import WriterHandle, spawn_writer
from trainer.checkpoint.writing import (
    AttemptFailed,
    Event,
    Published,
    PublishFailed,
    SaveRequest,
    SaveWork,
    Staged,
)
from trainer.config import CheckpointConfig
from trainer.telemetry.log import event


@dataclass
class CheckpointStats:
    """What the metrics exporter reports about checkpoints and snapshots."""

    saves_total: int = 0
    failures_total: int = 0
    last_success_step: int | None = None
    last_success_timestamp: float | None = None
    last_bytes: int = 0
    last_write_seconds: float = 0.0
    last_stall_seconds: float = 0.0
    snapshots_total: int = 0
    snapshot_failures_total: int = 0
    last_snapshot_step: int | None = None
    last_snapshot_bytes: int = 0
    last_snapshot_seconds: float = 0.0


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
        self._staged = threading.Event()
        self._durable_idle = threading.Event()
        self._staged.set()
        self._durable_idle.set()
        self._writing: int | None = None
        self._stalls: dict[int, float] = {}
        self._buffer: SharedStateBuffer | None = None
        self._process: WriterHandle | None = None
        self._inline: SaveWork | None = None
        self._snapshot_failing = False
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
        setup = WriterSetup(
            durable=None if self.durable is None else self.config,
            cache=self.cache,
            snapshots=snapshots,
            attempts=self.attempts,
            fence=None if self.durable is None else self.durable.fence,
        )
        self._send(setup)
        self._buffer = SharedStateBuffer()
        threading.Thread(target=self._listen, name="checkpoint-events", daemon=True).start()

    def save(
        self,
        state: dict[str, Any],
        *,
        step: int,
        epoch: int,
        world_size: int,
        durable: bool,
        wait_s: float | None = None,
    ) -> bool:
        """Copy `state` now and write it: a snapshot if this node keeps them, the durable
        checkpoint if `durable`. If the writes before it are still running after `wait_s`
        seconds, skip this one (logged) rather than hold up the ranks; where only the
        durable upload before it is (a slow store), the step is still kept in the snapshot,
        so that a stop in the middle of that upload loses nothing on this node: with a
        snapshot to fall back on, the upload is waited for half of `wait_s`, leaving the
        other half to write the snapshot (a stop's deadline covers both)."""
        durable = durable and self.durable is not None
        started = time.perf_counter()
        ready = self._staged.wait(wait_s)
        upload_wait_s = wait_s / 2 if wait_s is not None and self.snapshots is not None else wait_s
        if ready and durable and not self._durable_idle.wait(upload_wait_s):
            ready = self.snapshots is not None
            durable = False
            self.log.warning(
                "checkpoint step %d %s: the upload of step %s is still running after %.0fs",
                step, "kept in the snapshot only" if ready else "skipped", self._writing, upload_wait_s,
            )  # fmt: skip
        elif not ready:
            self.log.warning(
                "checkpoint step %d skipped: the write of step %s is still running after %.0fs",
                step, self._writing, wait_s,
            )  # fmt: skip
        if not ready:
            return False
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
        self._staged.clear()
        if durable:
            self._durable_idle.clear()
            self._writing = step
        self._send((request, shared))
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
        # let go of the writer before closing its stdin: it exits at once, and the listener
        # must not take an exit it sees while `_process` still names it for a death
        process, self._process = self._process, None
        if process is not None:
            process.stdin.close()  # the writer finishes what it holds and exits
        if self._buffer is not None:
            self._buffer.close()

    def _write_inline(self) -> None:
        """From now on, saves run in this process (`async_save=false`, or the writer died)."""
        snapshot_store = self.snapshots.checkpointer() if self.snapshots is not None else None
        self._inline = SaveWork(self.durable, snapshot_store, self.attempts, self._on_event)

    def _send(self, message: object) -> None:
        try:
            pickle.dump(message, self._process.stdin)
            self._process.stdin.flush()
        except OSError:  # the writer died: `_listen` reports it and switches to inline writes
            pass

    def _listen(self) -> None:
        """Turn the writer process's events into stats and log lines until it exits."""
        process = self._process
        while True:
            try:
                self._on_event(pickle.load(process.stdout))
            except (EOFError, OSError, pickle.UnpicklingError):
                break
        if self._process is process:  # it died under a running trainer
            code = process.wait()
            self.log.error(
                "the checkpoint writer process exited (code %s); writing checkpoints inline from now on", code
            )
            self._process = None
            self._write_inline()
            if not self._durable_idle.is_set():
                self._on_event(PublishFailed(self._writing or -1, 0))
            self._staged.set()

    def _on_event(self, happened: Event) -> None:
        stats = self.stats
        if isinstance(happened, Staged):
            self._on_staged(happened)
        elif isinstance(happened, AttemptFailed):
            self.log.warning(
                "checkpoint step %d attempt %d/%d failed: %s",
                happened.step, happened.attempt, happened.attempts, happened.error,
            )  # fmt: skip
        elif isinstance(happened, Published):
            stats.saves_total += 1
            stats.last_success_step, stats.last_success_timestamp = happened.step, time.time()
            stats.last_bytes, stats.last_write_seconds = happened.size_bytes, happened.seconds
            stall = self._stalls.pop(happened.step, 0.0)
            megabytes = happened.size_bytes / 1e6
            event(
                self.log,
                "checkpoint",
                f"checkpoint step {happened.step} -> {happened.location} ({megabytes:.1f} MB, "
                f"paused training {stall:.3f}s, written in {happened.seconds:.2f}s)",
                step=happened.step,
                location=happened.location,
                bytes=happened.size_bytes,
                write_seconds=round(happened.seconds, 4),
                stall_seconds=round(stall, 4),
            )
            self._durable_idle.set()
        elif isinstance(happened, PublishFailed):
            stats.failures_total += 1
            self._stalls.pop(happened.step, None)
            self.log.error(
                "CHECKPOINT FAILED: step %d was not saved after %d attempts; the newest checkpoint is "
                "still step %s",
                happened.step, happened.attempts, stats.last_success_step,
            )  # fmt: skip
            self._durable_idle.set()

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
        if self._writing != staged.step:
            self._stalls.pop(staged.step, None)
        self._staged.set()
