"""Node-local snapshots: the newest training state in memory-backed storage on every node.

Layout under `checkpoint.snapshot_dir`: one folder per checkpoint location (a hash of its
URI), and in it one folder per lineage, the id the store keeps in `lineage.json`. A run that
starts over (a new or emptied `checkpoint.uri`, or `checkpoint.resume=false`) gets a new
lineage, so snapshots a previous run left in /dev/shm are never mistaken for this one's, and
they are removed. Inside, snapshots are checkpoints in the store format (manifest, digests),
at most two: the oldest is removed before the next is written, so the newest intact one is
never overwritten. `reached` records the last step this node completed, for the count of
steps a recovery lost.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import mmap
import os
import shutil
import struct
from pathlib import Path
from typing import Any

from trainer.checkpoint.manager import Checkpointer
from trainer.checkpoint.shared_state import shared_memory_dir
from trainer.checkpoint.store import LocalStore
from trainer.config import CheckpointConfig

log = logging.getLogger("trainer.checkpoint")
KEEP = 2
# snapshot_every_steps=auto: the first after AUTO_FIRST steps, then re-sized at every
# progress log from what snapshots cost
AUTO_FIRST, AUTO_MIN, PAUSE_BUDGET = 20, 5, 0.005
REACHED_FILE = "reached"


def snapshot_root(config: CheckpointConfig) -> Path:
    """This checkpoint location's folder under `snapshot_dir`: named by the location's URI,
    a local one made absolute (`checkpoints/digits` in two folders is two locations)."""
    uri = config.uri if "://" in config.uri else str(Path(config.uri).resolve())
    digest = hashlib.sha256(uri.encode()).hexdigest()[:12]
    return Path(config.snapshot_dir) / digest


class SnapshotDir:
    """One node's snapshots of one lineage."""

    def __init__(self, config: CheckpointConfig, lineage: str) -> None:
        self.root = snapshot_root(config)
        self.folder = self.root / lineage
        self.lineage = lineage
        self._reached: mmap.mmap | None = None

    def __getstate__(self) -> dict[str, Any]:
        """What a writer process gets: the folder, not this process's mapped counter."""
        return {**self.__dict__, "_reached": None}

    def checkpointer(self) -> Checkpointer:
        """The snapshots as a store: published like checkpoints, the two newest kept."""
        return Checkpointer(LocalStore(self.folder), keep_last=KEEP, cache=self.folder, own_writes=True)

    def room_for(self, state_bytes: int) -> str | None:
        """Why two snapshots (and the shared host copy, when it lives on the same
        filesystem) do not fit, or None when they do. Space held by older snapshots of this
        lineage is counted as free: they are replaced."""
        self.root.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.root).free + _bytes_under(self.folder)
        copies = KEEP + (os.stat(self.root).st_dev == os.stat(shared_memory_dir()).st_dev)
        needed = copies * state_bytes
        if free >= needed:
            return None
        return (
            f"{self.root} has {free / 2**20:.0f} MiB free, {copies} copies of the "
            f"{state_bytes / 2**20:.0f} MiB state need {needed / 2**20:.0f} MiB"
        )

    def remove_other_lineages(self) -> None:
        """Snapshots of a run that started over are of no use to this one: free their memory."""
        if not self.root.is_dir():
            return
        for entry in self.root.iterdir():
            if entry.is_dir() and entry.name != self.lineage:
                shutil.rmtree(entry, ignore_errors=True)

    def newest(self) -> tuple[int, dict[str, Any]] | None:
        """The newest snapshot that verifies (its pieces' xxh3) and loads, with its state; damaged
        ones are named in a warning and skipped, and what a killed writer left half-written
        is removed (call it holding `writer_lock`)."""
        if not self.folder.is_dir():
            return None
        checkpointer = self.checkpointer()
        checkpointer.store.clean_staging(self.folder)
        for step in sorted(checkpointer.store.steps(), reverse=True):
            if checkpointer.fetch_verified(step):
                try:
                    return step, checkpointer.load(step)
                except Exception as error:  # whatever unpickling damaged bytes raises
                    log.warning("snapshot step %d in %s does not load (%s)", step, self.folder, error)
        return None

    def remove(self) -> None:
        """Free this location's snapshot memory (the run is over and the store holds its end)."""
        if self._reached is not None:
            self._reached.close()
            self._reached = None
        shutil.rmtree(self.root, ignore_errors=True)
        with contextlib.suppress(OSError):  # the snapshot folder too, unless another location's are there
            self.root.parent.rmdir()

    def reached(self) -> int | None:
        """The last step this node recorded as completed, if it kept its memory."""
        try:
            return struct.unpack("<q", (self.folder / REACHED_FILE).read_bytes()[:8])[0]
        except (FileNotFoundError, struct.error):
            return None

    def mark(self, step: int) -> None:
        """Record `step` as completed: one 8-byte store into a mapped page, cheap every step."""
        if self._reached is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            path = self.folder / REACHED_FILE
            with open(path, "a+b") as handle:
                handle.truncate(8)
                self._reached = mmap.mmap(handle.fileno(), 8)
        struct.pack_into("<q", self._reached, 0, step)


def auto_interval(pause_s: float, writer_s: float, step_s: float) -> int:
    """Steps between snapshots: enough that their pause of the loop costs at most
    PAUSE_BUDGET of training time and the writer is done before the next one, at least
    AUTO_MIN. A 53k-parameter CNN on two CPU cores gets ~50; a GPU step of 0.3 s with a
    0.5 s copy of its state, ~330."""
    by_pause = math.ceil(pause_s / (PAUSE_BUDGET * step_s))
    by_writer = math.ceil(writer_s / step_s) + 1
    return max(AUTO_MIN, by_pause, by_writer)


class SnapshotPacer:
    """snapshot_every_steps=auto on rank 0: the interval from costs smoothed over progress
    windows (one window holds one or two snapshots, each a noisy sample), changed only
    when it moves by more than a quarter, and growing at most twofold at a time. Costs are
    sampled only in windows that hold a snapshot, so one slow pause (a loaded machine, the
    first touch of shared memory) must not set an interval longer than the run: no snapshot
    would come to correct it (CI: snapshots at steps 20 and 40, then none in 720 steps)."""

    SMOOTHING, DEADBAND, MAX_GROWTH = 0.3, 0.25, 2

    def __init__(self) -> None:
        self.costs: list[float] | None = None  # smoothed pause, writer and step seconds

    def propose(self, current: int, pause_s: float, writer_s: float, step_s: float) -> int:
        sample = [pause_s, writer_s, step_s]
        old = self.costs or sample
        self.costs = [was + self.SMOOTHING * (now - was) for was, now in zip(old, sample, strict=True)]
        candidate = min(auto_interval(*self.costs), self.MAX_GROWTH * current)
        return candidate if abs(candidate - current) > self.DEADBAND * current else current


def _bytes_under(folder: Path) -> int:
    if not folder.is_dir():
        return 0
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
