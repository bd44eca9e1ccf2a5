"""Rank 0's checkpoint writes: snapshot at the step boundary, write in the background.

Training pauses only for the copy into host memory; serialization, upload, `latest.json`
and retention happen on a worker thread. One write is in flight at most: the next save
waits for it, for a bounded time (its peers wait in a collective meanwhile), and so does the
end of the run. A write that keeps failing is reported loudly and training goes on, since
the previous checkpoint is still intact.

Waiting is on an Event, not `Thread.join`: in Python 3.11 a signal handler that raises
while the main thread is in `join()` can leave the thread marked stopped, so that a later
`join()` returns at once while the upload still runs (and dies at exit)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from trainer.checkpoint.manager import Checkpointer
from trainer.log import event

log = logging.getLogger("trainer.checkpoint")
WRITER_NICENESS = 10


def to_host(value: Any) -> Any:
    """A private copy of every tensor in a nested state, on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: to_host(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(to_host(item) for item in value)
    return value


def _yield_cpu_to_training() -> None:
    """Lower this thread's CPU priority (Linux threads have their own nice value; the
    upload threads it starts inherit it), so serialization, hashing and upload fill idle
    cycles instead of taking them from the loop and its data loaders."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)


@dataclass
class CheckpointStats:
    """What the metrics exporter reports about checkpoints (written by the worker thread)."""

    saves_total: int = 0
    failures_total: int = 0
    last_success_step: int | None = None
    last_success_timestamp: float | None = None
    last_bytes: int = 0
    last_write_seconds: float = 0.0
    last_stall_seconds: float = 0.0


class CheckpointWriter:
    """Snapshots and writes checkpoints for rank 0; `background=False` writes inline."""

    def __init__(
        self, checkpointer: Checkpointer, *, background: bool, attempts: int, logger: logging.Logger
    ) -> None:
        self.checkpointer, self.background, self.attempts, self.log = (
            checkpointer,
            background,
            attempts,
            logger,
        )
        self.stats = CheckpointStats()
        self._idle = threading.Event()
        self._idle.set()
        self._writing: int | None = None

    def save(
        self, state: dict[str, Any], *, step: int, epoch: int, world_size: int, wait_s: float | None = None
    ) -> bool:
        """Copy `state` now; write it now or in the background. If the write before it is still
        running after `wait_s` seconds, skip this one (logged) rather than hold up the ranks."""
        if not self.wait(wait_s):
            self.log.warning(
                "checkpoint step %d skipped: the write of step %s is still running after %.0fs",
                step, self._writing, wait_s,
            )  # fmt: skip
            return False
        started = time.perf_counter()
        snapshot = to_host(state)
        self.stats.last_stall_seconds = time.perf_counter() - started
        if not self.background:
            self._write(snapshot, step, epoch, world_size)
            return True
        self._idle.clear()
        self._writing = step
        # a daemon thread: an exit waits for it only as long as `close` allows
        threading.Thread(
            target=self._write, args=(snapshot, step, epoch, world_size), name="checkpoint", daemon=True
        ).start()
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the write in flight has finished; False if `timeout` ran out first."""
        return self._idle.wait(timeout)

    def close(self, timeout: float) -> None:
        """Let the last write finish, for up to `timeout` seconds."""
        if not self.wait(timeout):
            self.log.error("checkpoint write still running after %.0fs; exiting without it", timeout)

    def _write(self, snapshot: dict[str, Any], step: int, epoch: int, world_size: int) -> None:
        try:
            self._write_with_retries(snapshot, step, epoch, world_size)
        finally:
            self._idle.set()

    def _write_with_retries(self, snapshot: dict[str, Any], step: int, epoch: int, world_size: int) -> None:
        if self.background:
            _yield_cpu_to_training()
        for attempt in range(1, self.attempts + 1):
            try:
                saved = self.checkpointer.save(snapshot, step=step, epoch=epoch, world_size=world_size)
            except Exception as error:  # any failure of this write; the run goes on
                self.log.warning(
                    "checkpoint step %d attempt %d/%d failed: %s", step, attempt, self.attempts, error
                )
                if attempt < self.attempts:
                    time.sleep(min(30.0, 2.0**attempt))
                continue
            stats = self.stats
            stats.saves_total += 1
            stats.last_success_step, stats.last_success_timestamp = step, time.time()
            stats.last_bytes, stats.last_write_seconds = saved.size_bytes, saved.seconds
            event(
                self.log,
                "checkpoint",
                f"checkpoint step {saved.step} -> {saved.location} ({saved.size_bytes / 1e6:.1f} MB, "
                f"paused training {stats.last_stall_seconds:.3f}s, written in {saved.seconds:.2f}s)",
                step=saved.step,
                location=saved.location,
                bytes=saved.size_bytes,
                write_seconds=round(saved.seconds, 4),
                stall_seconds=round(stats.last_stall_seconds, 4),
            )
            return
        self.stats.failures_total += 1
        self.log.error(
            "CHECKPOINT FAILED: step %d was not saved after %d attempts; the newest checkpoint is "
            "still step %s",
            step,
            self.attempts,
            self.stats.last_success_step,
        )
