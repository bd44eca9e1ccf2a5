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
from dataclasses import dataclass, field, replace
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
PROGRESS_EVERY_S = 1.0  # a writer with work says where it stands this often (its heartbeat)


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
        # what is being staged and what uploaded (at once, in a writer process): `current`
        self._activity: dict[str, Progress] = {}
        self._lock = threading.Lock()
        for checkpointer in (durable, snapshots):
            if checkpointer is not None:
                checkpointer.progress = self._bytes

    def current(self) -> Progress | None:
        """Where the work stands: the upload in flight, else the stage; None when idle."""
        with self._lock:
            return self._activity.get("upload") or self._activity.get("stage")

    def sent(self, nbytes: int) -> None:
        """Bytes of the upload in flight that reached the network."""
        with self._lock:
            if (upload := self._activity.get("upload")) is not None:
                self._activity["upload"] = replace(upload, done=upload.done + nbytes)

    def _bytes(self, phase: str, done: int, total: int) -> None:
        """A checkpointer's bytes in a phase of staging (serialize, hash) or of the upload."""
        with self._lock:
            kind = "upload" if phase == "upload" else "stage"
            if (now := self._activity.get(kind)) is not None:
                self._activity[kind] = replace(now, phase=phase, done=done, total=total)

    def _begin(self, kind: str, progress: Progress | None) -> None:
        with self._lock:
            if progress is None:
                self._activity.pop(kind, None)
            else:
                self._activity[kind] = progress

    def stage(self, state: dict[str, Any], request: SaveRequest) -> Path | None:
        """Write the snapshot and stage the durable checkpoint; the staging folder, if any.
        A failed snapshot is reported, not raised: the durable copy is the one that matters."""
        started = time.perf_counter()
        snapshot_path, staged = None, None
        size, error = 0, ""
        self._begin("stage", Progress(request.step, "stage", 0, 0))
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
            self._begin("stage", None)
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
                self._begin("upload", Progress(request.step, "upload", 0, 0, attempt))
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
            self._begin("upload", None)
            shutil.rmtree(staged, ignore_errors=True)
