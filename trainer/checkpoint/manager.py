"""The commit protocol over a store: checkpoint, then manifest, then `latest.json` last.

A step counts once its manifest is published and its bytes match the manifest's sha256 and
load; anything else is an interrupted or damaged write, and the newest earlier good step is
used. `latest.json`, written last and read back, points outside readers at the newest step.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, BinaryIO

import torch

from trainer.checkpoint.digest import PIECE_BYTES, PieceCheck, matches, piece_digests
from trainer.checkpoint.lease import LeaseFence
from trainer.checkpoint.store import CheckpointStore, StaleWrite
from trainer.config import ConfigError

CHECKPOINT_FILE, MANIFEST_FILE, LATEST_FILE = "checkpoint.pt", "manifest.json", "latest.json"
LINEAGE_FILE = "lineage.json"
FORMAT_VERSION = 1
_UNREAD = object()
log = logging.getLogger("trainer.checkpoint")


class CheckpointError(ConfigError):
    """A checkpoint that exists but cannot be used for this run."""


BytesDone = Callable[[str, int, int], None]  # phase, bytes done, bytes in all


class _CountingFile:
    """A file being written that reports how many bytes went in (torch.save accepts any
    object with write and flush): a long serialization is progress, not silence."""

    def __init__(self, handle: BinaryIO, report: Callable[[int], None]) -> None:
        self.handle, self.report, self.written = handle, report, 0

    def write(self, data: bytes) -> int:
        written = self.handle.write(data)
        self.written += written
        self.report(self.written)
        return written

    def flush(self) -> None:
        self.handle.flush()


@dataclass(frozen=True)
class SavedCheckpoint:
    """What one save wrote and how long it took."""

    step: int
    location: str
    size_bytes: int
    seconds: float


class Checkpointer:
    """Writes (rank 0 only), and finds, verifies and loads checkpoints (every rank).

    Checkpoints are read from a local file: the store's own for a directory, a download
    into the node-local `cache` for S3, so that each node downloads once."""

    def __init__(
        self,
        store: CheckpointStore,
        keep_last: int,
        cache: Path,
        fence: LeaseFence | None = None,
        own_writes: bool = False,
    ) -> None:
        """`fence`, on the rank that holds the location's lease, is checked before every
        publish, and its epoch goes into every manifest and `latest.json`. `own_writes`: only
        this pod's writer writes the store (its snapshots), so a restore checks the pieces'
        xxh3 rather than their sha256 (digest.py says why)."""
        self.store = store
        self.own_writes = own_writes
        self.keep_last = keep_last
        self.cache = cache
        self.fence = fence
        self.protected: set[int] = set()
        self.progress: BytesDone = lambda phase, done, total: None  # the writer's watch listens
        # `latest.json`'s version as this run last wrote or read it (read before the first write)
        self.latest_version: str | object | None = _UNREAD
        self._loaded: tuple[int, dict[str, Any]] | None = None

    @property
    def epoch(self) -> int:
        return 0 if self.fence is None else self.fence.epoch

    def latest(self) -> dict[str, Any] | None:
        """`latest.json` as it is now (its version kept for this run's next conditional
        write of it); None when absent or unreadable."""
        current = self.store.get_versioned(LATEST_FILE)
        self.latest_version = None if current is None else current[1]
        if current is None:
            return None
        try:
            document = json.loads(current[0])
            int(document["step"])
            return document
        except (ValueError, KeyError, TypeError):
            log.warning("%s/%s is unreadable; looking for steps in the store", self.store.uri, LATEST_FILE)
            return None

    def committed_step(self) -> int | None:
        """The step `latest.json` names, unverified; None when it is absent or unreadable."""
        latest = self.latest()
        return None if latest is None else int(latest["step"])

    def fence_latest(self) -> None:
        """Rewrite `latest.json` (same step, this run's epoch) against the version read just
        now: from here on, a write that a superseded run made against an older version is
        refused by the store (412, or the local compare-and-swap)."""
        latest = self.latest()
        if latest is None or latest.get("lease_epoch") == self.epoch:
            return
        self._write_latest({**latest, "lease_epoch": self.epoch})

    def find_resumable(self, newer_than: int | None = None) -> int | None:
        """The newest intact step in the store: manifest parsed, sha256 verified, loadable.

        `latest.json` is the pointer that readers outside the trainer follow; the trainer
        does not trust it alone, since a deleted, garbled or stale pointer must not send a
        run back to an older step. A step is complete once its manifest is published (it is
        written after the checkpoint), so a step newer than the pointer, left by a write that
        died before updating it, is used too. Each step skipped is named in a warning. The
        verified copy stays in the cache, and its loaded state in memory, for `load`. With
        `newer_than` (a snapshot's step) only newer steps are looked at, and finding none
        intact is no error."""
        every = sorted(self.store.steps(), reverse=True)
        steps = every if newer_than is None else [step for step in every if step > newer_than]
        latest = self.latest()
        committed = None if latest is None else int(latest["step"])
        if committed is not None and committed not in every:
            log.warning("%s/%s names step %d, which is not there", self.store.uri, LATEST_FILE, committed)
        for step in steps:
            if latest is not None and self._superseded_write(step, latest):
                continue
            if self.fetch_verified(step) and self._loads(step):
                if committed is not None and step != committed:
                    log.warning(
                        "resuming from step %d, the newest intact one; %s names step %d",
                        step, LATEST_FILE, committed,
                    )  # fmt: skip
                return step
        if steps and newer_than is None:
            raise CheckpointError(
                "checkpoint.uri",
                self.store.uri,
                f"holds steps {', '.join(map(str, sorted(steps)))} but none is intact (see the warnings); "
                "refusing to train from step 0 over them: move them aside or choose another checkpoint.uri",
            )
        return None

    def _superseded_write(self, step: int, latest: dict[str, Any]) -> bool:
        """Whether `step` is a late write of a run superseded since: newer than the step
        `latest.json` names, from an older lease epoch than the one that wrote it."""
        if step <= int(latest["step"]):
            return False
        try:
            manifest = json.loads(self.store.get(f"step-{step}/{MANIFEST_FILE}") or b"{}")
            epoch, newest = int(manifest.get("lease_epoch", 0)), int(latest.get("lease_epoch", 0))
        except (ValueError, TypeError, AttributeError):
            return False
        if epoch >= newest:
            return False
        log.warning(
            "checkpoint step %d in %s is a superseded run's late write (lease epoch %d, %s's %d); skipped",
            step, self.store.uri, epoch, LATEST_FILE, newest,
        )  # fmt: skip
        return True

    def fetch_verified(self, step: int) -> bool:
        """Bring step's checkpoint to a local file and check it against its manifest."""
        name = f"step-{step}/{CHECKPOINT_FILE}"
        raw_manifest = self.store.get(f"step-{step}/{MANIFEST_FILE}")
        if raw_manifest is None or not self.store.fetch(name, self.cache):
            log.warning("checkpoint step %d in %s is incomplete; skipping it", step, self.store.uri)
            return False
        try:
            manifest = json.loads(raw_manifest)
            size, check = int(manifest["bytes"]), self._check_of(manifest)
        except (ValueError, KeyError, TypeError):
            log.warning("checkpoint step %d in %s has a damaged manifest; skipping it", step, self.store.uri)
            self.store.evict(name, self.cache)
            return False
        path = self.store.local_path(name, self.cache)
        if path.stat().st_size != size or not matches(path, check):
            uri, algorithm = self.store.uri, check.algorithm
            log.warning("checkpoint step %d in %s fails its %s check; skipping it", step, uri, algorithm)
            self.store.evict(name, self.cache)
            return False
        return True

    def _check_of(self, manifest: dict[str, Any]) -> PieceCheck:
        """The manifest's pieces by this store's digest (xxh3 where `own_writes` and the
        manifest has them, else sha256), or, from before the pieces, its whole sha256."""
        algorithm = "xxh3" if self.own_writes and "xxh3_pieces" in manifest else "sha256"
        pieces = manifest.get(f"{algorithm}_pieces")
        if pieces is None:  # written before the pieces: one sha256 of the whole file
            return PieceCheck("sha256", None, 0, str(manifest["sha256"]))
        if not isinstance(pieces, list) or not all(isinstance(piece, str) for piece in pieces):
            raise TypeError(f"{algorithm}_pieces")
        return PieceCheck(algorithm, pieces, int(manifest["piece_bytes"]))

    def _loads(self, step: int) -> bool:
        """Whether a verified step also unpickles (bytes the manifest vouches for can still be
        garbage); the state is kept for this process's `load`."""
        try:
            self._loaded = (step, self.load(step))
            return True
        except Exception as error:  # whatever unpickling garbage raises
            reason = error.allowed if isinstance(error, CheckpointError) else error
            log.warning("checkpoint step %d does not load (%s); skipping it", step, reason)
        self.store.evict(f"step-{step}/{CHECKPOINT_FILE}", self.cache)
        return False

    def load(self, step: int) -> dict[str, Any]:
        """Load a fetched step, tensors only (`weights_only=True`)."""
        if self._loaded is not None and self._loaded[0] == step:
            state, self._loaded = self._loaded[1], None
            return state
        path = self.store.local_path(f"step-{step}/{CHECKPOINT_FILE}", self.cache)
        try:
            # mapped, not read: a snapshot in /dev/shm is loaded where it lies, and a file the
            # cache evicts meanwhile keeps its pages while they are mapped
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except FileNotFoundError:
            raise CheckpointError(
                "checkpoint.uri", self.store.uri, f"step {step} is not readable on this node ({path})"
            ) from None
        if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
            found = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise CheckpointError(
                "checkpoint.uri", self.store.uri, f"step {step} has format {found}, expected {FORMAT_VERSION}"
            )
        return state

    def release(self, step: int) -> None:
        """Drop this node's downloaded copy once every local rank has loaded it."""
        self.store.evict(f"step-{step}/{CHECKPOINT_FILE}", self.cache)

    def save(self, state: dict[str, Any], *, step: int, epoch: int, world_size: int) -> SavedCheckpoint:
        """Stage the checkpoint, publish it as the step, name it in `latest.json`, apply retention."""
        started = time.perf_counter()
        staging = self.stage(state, step=step, epoch=epoch, world_size=world_size)
        return self.commit(step, staging, started)

    def stage(self, state: dict[str, Any], *, step: int, epoch: int, world_size: int) -> Path:
        """Serialize the checkpoint and its manifest into a new staging folder of the store."""
        staging = self.store.staging(step, self.cache)
        try:
            checkpoint = staging / CHECKPOINT_FILE
            with open(checkpoint, "wb") as handle:
                torch.save({"format": FORMAT_VERSION, **state}, _CountingFile(handle, self._staged_bytes))
            size = checkpoint.stat().st_size
            digests = piece_digests(checkpoint, lambda done: self.progress("hash", done, size))
            manifest = {
                "step": step,
                "epoch": epoch,
                "world_size": world_size,
                **{f"{algorithm}_pieces": pieces for algorithm, pieces in digests.items()},
                "piece_bytes": PIECE_BYTES,
                "bytes": size,
                "created_at": datetime.now(timezone.utc).isoformat(),
                "lease_epoch": self.epoch,
            }
            (staging / MANIFEST_FILE).write_bytes(_json(manifest))
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return staging

    def _staged_bytes(self, done: int) -> None:
        self.progress("serialize", done, 0)

    def adopt(self, step: int, staged: Path) -> Path:
        """A staging folder of this store holding the files of `staged` (another store's, or
        one a publish would consume): hard links where they share a filesystem, else copies."""
        staging = self.store.staging(step, self.cache)
        for name in (CHECKPOINT_FILE, MANIFEST_FILE):
            try:
                os.link(staged / name, staging / name)
            except OSError:
                shutil.copyfile(staged / name, staging / name)
        return staging

    def commit(self, step: int, staging: Path, started: float | None = None) -> SavedCheckpoint:
        """Publish a staged step, then name it in `latest.json` (read back), then apply
        retention; the staging folder is consumed. Each write that names a step is
        conditional in the store, on what this run saw before it checked the lease: the
        step's manifest on its version read first (absent for a new step), `latest.json` on
        the version this run last wrote or read. So a run that lost the lease, or paused
        between its check and its write, is refused by the store, not only by its own check."""
        started = time.perf_counter() if started is None else started
        size = (staging / CHECKPOINT_FILE).stat().st_size
        current = self.store.get_versioned(f"step-{step}/{MANIFEST_FILE}")
        self._check_fence(staging)
        self.store.publish(
            step, staging, [CHECKPOINT_FILE, MANIFEST_FILE], current and current[1],
            lambda done: self.progress("upload", done, size),
        )  # fmt: skip
        self._check_fence()
        self._write_latest({"step": step, "path": f"step-{step}", "lease_epoch": self.epoch})
        self._apply_retention(step)
        return SavedCheckpoint(step, self.store.location(step), size, time.perf_counter() - started)

    def _write_latest(self, document: dict[str, Any]) -> None:
        """`latest.json`, conditional on the version this run last wrote or read; read back
        (a store may acknowledge and lose it). A refusal while the lease is still ours was
        a superseded run's late write landing first: it is replaced, once, in a warning."""
        pointer = _json(document)
        if self.latest_version is _UNREAD:
            self.latest()
        version = self.store.put_if(LATEST_FILE, pointer, self.latest_version)
        if version is None:
            self._check_fence()
            found = self.latest()
            log.warning(
                "%s/%s changed under this run (now step %s): a superseded run's late write; replacing it",
                self.store.uri, LATEST_FILE, found and found.get("step"),
            )  # fmt: skip
            version = self.store.put_if(LATEST_FILE, pointer, self.latest_version)
            if version is None:
                raise StaleWrite(f"{self.store.uri}/{LATEST_FILE} keeps changing under this run")
        self.latest_version = version
        if self.store.get(LATEST_FILE) != pointer:
            raise OSError(f"{self.store.uri}/{LATEST_FILE} does not read back as written")

    def _check_fence(self, staging: Path | None = None) -> None:
        if self.fence is None:
            return
        try:
            self.fence.check(self.store)
        except BaseException:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
            raise

    def keep_newest(self, count: int) -> None:
        """Remove all but the newest `count` steps."""
        steps = self.store.steps()
        for step in steps[: max(0, len(steps) - count)]:
            self.store.delete_step(step)

    def lineage(self, *, fresh: bool) -> str:
        """The id of the run history this store holds (`lineage.json`): created when absent,
        or anew when `fresh` (a run that starts over), so node-local snapshots of any other
        history are told apart from this one's."""
        raw = None if fresh else self.store.get(LINEAGE_FILE)
        try:
            return str(json.loads(raw)["id"]) if raw is not None else self._new_lineage()
        except (ValueError, KeyError, TypeError):
            log.warning("%s/%s is unreadable; starting a new lineage", self.store.uri, LINEAGE_FILE)
            return self._new_lineage()

    def _new_lineage(self) -> str:
        lineage = uuid.uuid4().hex[:16]
        created = datetime.now(timezone.utc).isoformat()
        self.store.put(LINEAGE_FILE, _json({"id": lineage, "created_at": created}))
        return lineage

    def _apply_retention(self, latest: int) -> None:
        """Keep the newest `keep_last` steps, the latest one and any this run resumed from.
        Each removal is conditional on the step's manifest as read before the lease check:
        a step another writer replaced since is left alone."""
        if self.keep_last == 0:
            return
        older = [s for s in self.store.steps() if s <= latest]
        keep = set(older[-self.keep_last :]) | {latest} | self.protected
        doomed = {
            step: self.store.get_versioned(f"step-{step}/{MANIFEST_FILE}")
            for step in older
            if step not in keep
        }
        if not doomed:
            return
        self._check_fence()
        for step, current in doomed.items():
            self.store.delete_step(step, current[1] if current else None)


def _json(document: dict[str, Any]) -> bytes:
    return (json.dumps(document, indent=2) + "\n").encode()
