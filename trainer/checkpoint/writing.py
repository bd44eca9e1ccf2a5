"""What one save does, wherever it runs (the writer process, or inline with `async_save=false`).

Two phases. `stage` serializes: the node-local snapshot is published at once, the durable
checkpoint is staged on local disk; after it the state's host copy is free for the next
save. `publish` uploads the staged checkpoint with retries and commits it. Each phase
reports what happened as small events, which the training process turns into log lines,
metrics and the waits of the next save.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.checkpoint.lease import LeaseLost
from trainer.checkpoint.manager import Checkpointer


@dataclass(frozen=True)
class SaveRequest:
    """One save: its step, and which copies it makes."""

    step: int
    epoch: int
    world_size: int
    snapshot: bool
    durable: bool
    protected: frozenset[int] = field(default_factory=frozenset)


@dataclass(frozen=True)
class Staged:
    """The state's host copy has been read: the next save may overwrite it. `durable` is
    the staged durable checkpoint's folder, complete, until it is published."""

    step: int
    snapshot_bytes: int = 0
    snapshot_seconds: float = 0.0
    snapshot_error: str = ""
    durable: str = ""


@dataclass(frozen=True)
class Progress:
    """The writer is working: on `step`, in `phase` (serialize, hash, upload), `done` of
    `total` bytes (0: not known), in attempt `attempt` of the upload (0 before it)."""

    step: int
    phase: str
    done: int
    total: int
    attempt: int = 0


@dataclass(frozen=True)
class Coalesced:
    """The durable write of `step`, still waiting for the upload before it, was replaced by
    the newer `by`: only the newest pending state is written."""

    step: int
    by: int


@dataclass(frozen=True)
class AttemptFailed:
    step: int
    attempt: int
    attempts: int
    error: str


@dataclass(frozen=True)
class Published:
    step: int
    location: str
    size_bytes: int
    seconds: float


@dataclass(frozen=True)
class PublishFailed:
    """The durable checkpoint of `step` was not saved (every attempt failed)."""

    step: int
    attempts: int


Event = Staged | Progress | Coalesced | AttemptFailed | Published | PublishFailed
PROGRESS_EVERY_S = 0.5  # the most often a writer reports its bytes


class SaveWork:
    """Runs the phases of a save against the durable store and the node's snapshots."""

    def __init__(
        self,
        durable: Checkpointer | None,
        snapshots: Checkpointer | None,
        attempts: int,
        report: Callable[[Event], None],
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.durable, self.snapshots, self.attempts = durable, snapshots, attempts
        self.report, self.sleep = report, sleep
        # the step being staged and the one being uploaded, at once in a writer process
        self._staging, self._uploading, self._attempt, self._reported_at = 0, 0, 0, 0.0
        self._sent = 0  # bytes of the current upload attempt on the wire (`sent`)
        self._lock = threading.Lock()
        for checkpointer in (durable, snapshots):
            if checkpointer is not None:
                checkpointer.progress = self._bytes

    def sent(self, nbytes: int) -> None:
        """Bytes of the upload in flight that reached the network."""
        with self._lock:
            self._sent += nbytes
            sent = self._sent
        self._bytes("upload", sent, 0)

    def _bytes(self, phase: str, done: int, total: int) -> None:
        """A checkpointer's bytes, reported at most every PROGRESS_EVERY_S (the upload's
        callback comes from several threads)."""
        now = time.monotonic()
        with self._lock:
            if now - self._reported_at < PROGRESS_EVERY_S:
                return
            self._reported_at = now
        upload = phase == "upload"
        step = self._uploading if upload else self._staging
        self.report(Progress(step, phase, done, total, self._attempt if upload else 0))

    def stage(self, state: dict[str, Any], request: SaveRequest) -> Path | None:
        """Write the snapshot and stage the durable checkpoint; the staging folder, if any.
        A failed snapshot is reported, not raised: the durable copy is the one that matters."""
        started = time.perf_counter()
        snapshot_path, staged = None, None
        size, error = 0, ""
        self._staging = request.step
        self.report(Progress(request.step, "stage", 0, 0))
        if request.snapshot and self.snapshots is not None:
            try:
                self.snapshots.keep_newest(1)  # the newest intact one stays while the next is written
                saved = self.snapshots.save(
                    state, step=request.step, epoch=request.epoch, world_size=request.world_size
                )
                size, snapshot_path = saved.size_bytes, Path(saved.location)
            except Exception as failure:  # full /dev/shm, anything: the run goes on
                error = str(failure) or type(failure).__name__
        snapshot_seconds = time.perf_counter() - started
        try:
            if request.durable and self.durable is not None:
                staged = (
                    self.durable.adopt(request.step, snapshot_path)
                    if snapshot_path is not None
                    else self.durable.stage(
                        state, step=request.step, epoch=request.epoch, world_size=request.world_size
                    )
                )
        except Exception as failure:  # staging failed: reported as a failed durable write
            self.report(AttemptFailed(request.step, 1, 1, str(failure)))
            self.report(PublishFailed(request.step, 1))
        finally:
            self.report(Staged(request.step, size, snapshot_seconds, error, str(staged or "")))
        return staged

    def publish(self, staged: Path, request: SaveRequest) -> None:
        """Publish the staged checkpoint, retrying with back-off; each attempt works on hard
        links of the staged files, since a publish consumes what it is given."""
        assert self.durable is not None
        self.durable.protected = set(request.protected)
        started = time.perf_counter()
        try:
            for attempt in range(1, self.attempts + 1):
                spare: Path | None = None
                self._uploading, self._attempt, self._sent = request.step, attempt, 0
                self.report(Progress(request.step, "upload", 0, 0, attempt))
                try:
                    spare = self.durable.adopt(request.step, staged) if attempt < self.attempts else staged
                    saved = self.durable.commit(request.step, spare, started)
                except Exception as error:  # any failure of this attempt; the run goes on
                    self.report(AttemptFailed(request.step, attempt, self.attempts, str(error)))
                    if spare is not None:
                        shutil.rmtree(spare, ignore_errors=True)
                    if isinstance(error, LeaseLost):  # no later attempt may publish either
                        self.report(PublishFailed(request.step, attempt))
                        return
                    if attempt < self.attempts:
                        self.sleep(min(30.0, 2.0**attempt))
                    continue
                self.report(Published(saved.step, saved.location, saved.size_bytes, saved.seconds))
                return
            self.report(PublishFailed(request.step, self.attempts))
        finally:
            shutil.rmtree(staged, ignore_errors=True)
