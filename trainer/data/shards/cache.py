"""A node's shard cache: a folder that the node's ranks share, of bounded size.

Files are named by their sha256, so a rewritten dataset never serves a stale shard and two
datasets share what they have in common. One rank downloads a shard while the others on the
node wait for it (a lock file per shard), so a node fetches each shard once per pass over
the cache, not once per rank. Past `limit_bytes` the least recently read files go first;
a file removed while another rank opens it is simply fetched again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from trainer.data.base import DataError
from trainer.data.shards.index import ShardEntry


def mismatch(entry: ShardEntry, data: bytes) -> str | None:
    """How `data` differs from what the index says of the shard, or None."""
    if len(data) != entry.bytes:
        return f"{len(data)} bytes, the index says {entry.bytes}"
    if hashlib.sha256(data).hexdigest() != entry.sha256:
        return "its sha256 differs from the index"
    return None


def default_cache_dir() -> Path:
    return Path(tempfile.gettempdir()) / "ddp-trainer-shards"


class ShardCache:
    def __init__(self, folder: Path, limit_bytes: int, where: str) -> None:
        self.folder, self.limit_bytes, self.where = folder, limit_bytes, where
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise DataError("data.shards.cache_dir", str(folder), f"cannot be created ({error})") from None

    def get(self, entry: ShardEntry, fetch: Callable[[str], bytes]) -> bytes:
        """The shard's verified bytes: from this node's cache, else fetched (by one rank)."""
        path = self.folder / entry.sha256
        if (data := self._read(path, entry)) is not None:
            return data
        with self._locked(entry):
            if (data := self._read(path, entry)) is not None:  # another rank fetched it meanwhile
                return data
            data = fetch(entry.file)
            self._check(entry, data)
            self._evict(room_for=len(data))
            staging = path.with_name(f".{path.name}.{os.getpid()}")
            with contextlib.suppress(OSError):  # a full disk costs the cache, not the run
                staging.write_bytes(data)
                staging.rename(path)
            return data

    def _check(self, entry: ShardEntry, data: bytes) -> None:
        if (problem := mismatch(entry, data)) is not None:
            raise DataError("data.path", self.where, f"{entry.file} is corrupt: {problem}")

    def _read(self, path: Path, entry: ShardEntry) -> bytes | None:
        try:
            data = path.read_bytes()
        except OSError:
            return None
        if mismatch(entry, data) is not None:
            path.unlink(missing_ok=True)  # damaged in the cache: fetch it again
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # recently read: evicted last
        return data

    @contextlib.contextmanager
    def _locked(self, entry: ShardEntry):
        with open(self.folder / f".lock-{entry.sha256}", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _evict(self, room_for: int) -> None:
        files = []
        for path in self.folder.iterdir():
            if not path.name.startswith("."):
                with contextlib.suppress(OSError):
                    stat = path.stat()
                    files.append((stat.st_mtime, stat.st_size, path))
        used = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if used + room_for <= self.limit_bytes:
                break
            path.unlink(missing_ok=True)
            used -= size
