"""Where checkpoint bytes live: one interface, a local directory here and S3 in `s3.py`.

A store knows files and steps, nothing about torch: `put_step` publishes a step's files all
at once or not at all, `put` replaces one small file atomically (used for `latest.json`).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from trainer.config import ConfigError

_STEP_DIR = re.compile(r"^step-(\d+)$")


class StaleWrite(OSError):
    """The store refused a write made against what this run last saw there: another writer
    came between (a conditional write's 412, or the local store's compare-and-swap)."""


class CheckpointStore(ABC):
    """Files under one URI, grouped in `step-<N>/` folders."""

    uri: str

    @abstractmethod
    def prepare(self) -> None:
        """Fail now, before training, if checkpoints could not be written (a probe write)."""

    @abstractmethod
    def clean_staging(self, scratch: Path) -> None:
        """Remove what writes that a crash interrupted left behind; rank 0 calls it at
        start, when no write of this job can be in flight."""

    @abstractmethod
    def staging(self, step: int, scratch: Path) -> Path:
        """A new, empty local folder to write step's files into (a remote store uses
        `scratch`, the node-local cache, for it)."""

    @abstractmethod
    def publish(
        self,
        step: int,
        staging: Path,
        order: list[str],
        expected: str | None,
        progress: Callable[[int], None] = lambda done: None,
    ) -> None:
        """Make the staged files `step-<N>/<name>`, in `order`, atomically where the store
        can; the staging folder is consumed either way. The last file names the step, and
        is written only if that file is still at version `expected` (absent for None), else
        StaleWrite. `progress` hears the bytes sent so far."""

    @abstractmethod
    def put(self, name: str, data: bytes) -> None:
        """Replace one top-level file atomically."""

    @abstractmethod
    def get(self, name: str) -> bytes | None:
        """A small file's bytes (`latest.json`, a manifest), or None when it is absent."""

    @abstractmethod
    def get_versioned(self, name: str) -> tuple[bytes, str] | None:
        """A small file's bytes and a version that changes with every write (S3's ETag), or
        None when it is absent: what `put_if` compares against."""

    @abstractmethod
    def put_if(self, name: str, data: bytes, version: str | None) -> str | None:
        """Write `name` only if it is absent (`version` None) or still at `version`, as one
        atomic step: its new version, or None when that precondition fails (another writer
        came first)."""

    @abstractmethod
    def delete_if(self, name: str, version: str) -> bool:
        """Remove `name` only if it is still at `version`; False otherwise."""

    @abstractmethod
    def local_path(self, name: str, cache: Path) -> Path:
        """Where a local copy of `name` lives: the file itself in a directory store, a file
        under the node-local `cache` for a remote one."""

    @abstractmethod
    def fetch(self, name: str, cache: Path) -> bool:
        """Make `local_path(name, cache)` hold `name` (download it if remote); False if absent."""

    @abstractmethod
    def evict(self, name: str, cache: Path) -> None:
        """Drop a local copy made by `fetch`."""

    @abstractmethod
    def names(self, prefix: str) -> list[str]:
        """Every object's name under `prefix` (a folder's, ending in /), sorted."""

    @abstractmethod
    def steps(self) -> list[int]:
        """Published steps, oldest first."""

    @abstractmethod
    def delete_step(self, step: int, version: str | None = None) -> bool:
        """Remove a step folder and everything in it; with `version`, only if its naming
        file (the manifest) is still at that version, removed first, as one conditional
        step (False when it was not)."""

    @abstractmethod
    def location(self, step: int) -> str:
        """Where a step lives, for humans."""


class LocalStore(CheckpointStore):
    """A directory on a local or shared filesystem; publication is a directory rename."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.uri = str(root)

    def prepare(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".probe-{uuid.uuid4().hex}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as error:
            raise ConfigError("checkpoint.uri", self.uri, f"not writable ({error.strerror})") from None

    def clean_staging(self, scratch: Path) -> None:
        for leftover in self.root.glob(".step-*"):
            shutil.rmtree(leftover, ignore_errors=True)

    def staging(self, step: int, scratch: Path) -> Path:
        folder = self.root / f".step-{step}.tmp-{uuid.uuid4().hex[:8]}"
        folder.mkdir(parents=True)
        return folder

    def publish(
        self,
        step: int,
        staging: Path,
        order: list[str],
        expected: str | None,
        progress: Callable[[int], None] = lambda done: None,
    ) -> None:
        """A directory rename, as a compare-and-swap under the directory's lock: the step's
        naming file must still be at `expected`."""
        done = 0
        for name in order:
            _sync_file(staging / name)
            done += (staging / name).stat().st_size
            progress(done)
        final = self.root / f"step-{step}"
        try:
            with self._locked(final.name):
                current = self.get_versioned(f"{final.name}/{order[-1]}")
                if (current and current[1]) != expected:
                    raise StaleWrite(f"{final}/{order[-1]} changed under this write (another writer)")
                if final.exists():  # a replay after a restart, or a superseded run's late step
                    stale = self.root / f".step-{step}.old-{uuid.uuid4().hex[:8]}"
                    final.rename(stale)
                    shutil.rmtree(stale)
                staging.rename(final)
                _sync_directory(self.root)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def put(self, name: str, data: bytes) -> None:
        final = self.root / name
        final.parent.mkdir(parents=True, exist_ok=True)  # a name may hold folders, as a key does
        staging = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex[:8]}")
        _write_synced(staging, data)
        os.replace(staging, final)
        _sync_directory(final.parent)

    def get(self, name: str) -> bytes | None:
        try:
            return (self.root / name).read_bytes()
        except FileNotFoundError:
            return None

    def get_versioned(self, name: str) -> tuple[bytes, str] | None:
        data = self.get(name)
        return None if data is None else (data, hashlib.sha256(data).hexdigest())

    def put_if(self, name: str, data: bytes, version: str | None) -> str | None:
        with self._locked(name):
            current = self.get_versioned(name)
            if (current[1] if current else None) != version:
                return None
            self.put(name, data)
            return hashlib.sha256(data).hexdigest()

    def delete_if(self, name: str, version: str) -> bool:
        with self._locked(name):
            current = self.get_versioned(name)
            if current is None or current[1] != version:
                return False
            (self.root / name).unlink()
            return True

    @contextmanager
    def _locked(self, name: str) -> Iterator[None]:
        """An exclusive lock for a compare-and-swap of `name`: flock(2) on the directory
        itself, which holds between processes, goes with its holder and leaves no file."""
        self.root.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(self.root, os.O_RDONLY)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
            yield
        finally:
            os.close(descriptor)  # releases the lock

    def local_path(self, name: str, cache: Path) -> Path:
        return self.root / name

    def fetch(self, name: str, cache: Path) -> bool:
        return (self.root / name).is_file()

    def evict(self, name: str, cache: Path) -> None:
        """Nothing to drop: the directory's own file is the local copy."""

    def names(self, prefix: str) -> list[str]:
        folder = self.root / prefix
        found = folder.rglob("*") if folder.is_dir() else ()
        return sorted(str(path.relative_to(self.root)) for path in found if path.is_file())

    def steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        found = (_STEP_DIR.match(entry.name) for entry in self.root.iterdir() if entry.is_dir())
        return sorted(int(match[1]) for match in found if match)

    def delete_step(self, step: int, version: str | None = None) -> bool:
        folder = self.root / f"step-{step}"
        if version is None:
            shutil.rmtree(folder, ignore_errors=True)
            return True
        with self._locked(folder.name):
            current = self.get_versioned(f"{folder.name}/manifest.json")
            if current is None or current[1] != version:
                return False
            gone = self.root / f".step-{step}.old-{uuid.uuid4().hex[:8]}"
            folder.rename(gone)
        shutil.rmtree(gone, ignore_errors=True)
        return True

    def location(self, step: int) -> str:
        return str(self.root / f"step-{step}")


def _sync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _sync_directory(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
