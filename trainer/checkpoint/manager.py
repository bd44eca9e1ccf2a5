"""The commit protocol over a store: checkpoint, then manifest, then `latest.json` last.

A step counts only once `latest.json` has named it and its bytes match the manifest's
sha256; anything else is an interrupted write, and the newest earlier good step is used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint.store import CheckpointStore
from trainer.config import ConfigError

CHECKPOINT_FILE, MANIFEST_FILE, LATEST_FILE = "checkpoint.pt", "manifest.json", "latest.json"
FORMAT_VERSION = 1
log = logging.getLogger("trainer.checkpoint")


class CheckpointError(ConfigError):
    """A checkpoint that exists but cannot be used for this run."""


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

    def __init__(self, store: CheckpointStore, keep_last: int, cache: Path) -> None:
        self.store = store
        self.keep_last = keep_last
        self.cache = cache
        self.protected: set[int] = set()

    def committed_step(self) -> int | None:
        """The step `latest.json` names, unverified; None for an empty location."""
        raw = self.store.get(LATEST_FILE)
        if raw is None:
            return None
        try:
            return int(json.loads(raw)["step"])
        except (ValueError, KeyError, TypeError):
            log.warning("%s/%s is unreadable; ignoring it", self.store.uri, LATEST_FILE)
            return None

    def find_resumable(self) -> int | None:
        """The newest committed step whose bytes verify, falling back step by step.
        The verified copy stays in the cache for this node's ranks to load."""
        committed = self.committed_step()
        if committed is None:
            return None
        for step in sorted((s for s in self.store.steps() if s <= committed), reverse=True):
            if self.fetch_verified(step):
                return step
        log.warning("no intact checkpoint at or before step %d in %s", committed, self.store.uri)
        return None

    def fetch_verified(self, step: int) -> bool:
        """Bring step's checkpoint to a local file and check it against its manifest."""
        name = f"step-{step}/{CHECKPOINT_FILE}"
        raw_manifest = self.store.get(f"step-{step}/{MANIFEST_FILE}")
        if raw_manifest is None or not self.store.fetch(name, self.cache):
            log.warning("checkpoint step %d in %s is incomplete; skipping it", step, self.store.uri)
            return False
        manifest = json.loads(raw_manifest)
        path = self.store.local_path(name, self.cache)
        if manifest.get("bytes") != path.stat().st_size or manifest.get("sha256") != _sha256_file(path):
            log.warning("checkpoint step %d in %s fails its sha256 check; skipping it", step, self.store.uri)
            self.store.evict(name, self.cache)
            return False
        return True

    def load(self, step: int) -> dict[str, Any]:
        """Load a fetched step, tensors only (`weights_only=True`)."""
        path = self.store.local_path(f"step-{step}/{CHECKPOINT_FILE}", self.cache)
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise CheckpointError(
                "checkpoint.uri", self.store.uri, f"step {step} is not readable on this node ({path})"
            ) from None
        if state.get("format") != FORMAT_VERSION:
            raise CheckpointError(
                "checkpoint.uri",
                self.store.uri,
                f"step {step} has format {state.get('format')}, expected {FORMAT_VERSION}",
            )
        return state

    def release(self, step: int) -> None:
        """Drop this node's downloaded copy once every local rank has loaded it."""
        self.store.evict(f"step-{step}/{CHECKPOINT_FILE}", self.cache)

    def save(self, state: dict[str, Any], *, step: int, epoch: int, world_size: int) -> SavedCheckpoint:
        """Stage the checkpoint and its manifest on local disk, publish them as the step,
        then name it in `latest.json`, then apply retention."""
        started = time.perf_counter()
        staging = self.store.staging(step, self.cache)
        try:
            checkpoint = staging / CHECKPOINT_FILE
            torch.save({"format": FORMAT_VERSION, **state}, checkpoint)
            size = checkpoint.stat().st_size
            manifest = {
                "step": step,
                "epoch": epoch,
                "world_size": world_size,
                "sha256": _sha256_file(checkpoint),
                "bytes": size,
                "created_at": datetime.now(timezone.utc).isoformat(),
            }
            (staging / MANIFEST_FILE).write_bytes(_json(manifest))
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        self.store.publish(step, staging, [CHECKPOINT_FILE, MANIFEST_FILE])
        self.store.put(LATEST_FILE, _json({"step": step, "path": f"step-{step}"}))
        self._apply_retention(step)
        return SavedCheckpoint(step, self.store.location(step), size, time.perf_counter() - started)

    def _apply_retention(self, latest: int) -> None:
        """Keep the newest `keep_last` steps, the latest one and any this run resumed from."""
        if self.keep_last == 0:
            return
        older = [s for s in self.store.steps() if s <= latest]
        keep = set(older[-self.keep_last :]) | {latest} | self.protected
        for step in older:
            if step not in keep:
                self.store.delete_step(step)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(2**22), b""):
            digest.update(block)
    return digest.hexdigest()


def _json(document: dict[str, Any]) -> bytes:
    return (json.dumps(document, indent=2) + "\n").encode()
