"""Each rank's progress, where a watcher outside the rank can read it.

A rank that stops making progress (a process stopped or paged out, a deadlock, a stuck
kernel, a storage stall) crashes nothing: its peers wait in the next collective and
torchrun, which only polls for exits, sees healthy workers. So every rank keeps one
72-byte record in a node-local file, mapped into memory: the phase it is in (start-up,
resume, the first step's compile, step, validation, checkpoint, test, finish), since when,
its last step, how long that phase may take, and which process it is (its pid and when
that process started: a rank that died leaves its pid behind, and with Linux's default
pid_max of 32768 a busy node hands that number to another process within minutes, which a
watcher must not signal). The watchdog (`trainer.distributed.watchdog`, a separate
process) reads the records and acts on one that overruns.

A phase's limit is derived from what was observed: `multiple` times the longest recent
duration of that phase, at least `floor_s`; a phase not yet seen gets `first_s`. A
fixed `timeout_s` replaces the derived limits. A step boundary costs one `pack_into` into
the mapped page, about a microsecond.
"""

from __future__ import annotations

import contextlib
import faulthandler
import mmap
import os
import shutil
import signal
import struct
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.process_identity import process_start, signal_process, still_running

if TYPE_CHECKING:  # the watchdog process reads records without the config's imports
    from trainer.config import WatchdogConfig

PHASES = ("start-up", "resume", "step", "validation", "checkpoint", "test", "finish", "done", "compile")
STARTUP, RESUME, STEP, VALIDATION, CHECKPOINT, TEST, FINISH, DONE, COMPILE = PHASES
# pid, rank, step, phase, since (CLOCK_MONOTONIC, the same in every process of a host),
# limit in seconds, the main thread's id (to find its stack in a dump), a write counter,
# and the process's start in clock ticks after boot (/proc/PID/stat's 22nd field; 0 where
# there is no /proc)
_LAYOUT = struct.Struct("<qqqqddQqq")
RECORD_BYTES = _LAYOUT.size
STACK_SIGNAL = signal.SIGUSR1  # asks a rank for its Python stacks (faulthandler, in C)
# set by `ddp-launch` so that it can read the records of every generation of workers
HEARTBEAT_DIR_ENV = "TRAINER_HEARTBEAT_DIR"
BUCKET_STEPS = 100  # "recent": the longest step of the last 100-200


@dataclass(frozen=True)
class Record:
    """One rank's progress as the watchdog reads it."""

    pid: int
    rank: int
    step: int
    phase: str
    since: float
    limit_s: float
    main_thread: int
    started: int  # the process's start (`process_start`), which tells it from a later one with its pid

    def silent_s(self, now: float) -> float:
        return now - self.since

    def overdue(self, now: float) -> bool:
        return self.phase != DONE and self.silent_s(now) > self.limit_s


def heartbeat_dir(run_id: str, restart_count: int, node_rank: int) -> Path:
    """The folder of one generation of one node's workers (a torchrun restart is a new
    one): its watchdog reads this node's records only, even where two nodes share a host."""
    base = os.environ.get(HEARTBEAT_DIR_ENV) or str(Path(tempfile.gettempdir()) / f"ddp-heartbeat-{run_id}")
    return Path(base) / f"restart-{restart_count}-node-{node_rank}"


def remove_generation(folder: Path) -> None:
    """A generation's records gone with it, and the run's folder once no generation is left:
    the node's watchdog does this at its end, and a world of one, which has none, itself."""
    shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):
        folder.parent.rmdir()


def stack_file(folder: Path, rank: int) -> Path:
    return folder / f"rank-{rank}.stack"


def read_records(folder: Path) -> list[Record]:
    """Every record in `folder` that reads consistently (twice the same bytes)."""
    records = []
    for path in sorted(folder.glob("rank-*.beat")):
        try:
            with open(path, "rb") as handle:
                first, second = handle.read(_LAYOUT.size), None
                handle.seek(0)
                second = handle.read(_LAYOUT.size)
        except OSError:
            continue
        if len(first) < _LAYOUT.size or first != second:
            continue
        pid, rank, step, phase, since, limit, thread, _, started = _LAYOUT.unpack(first)
        if 0 <= phase < len(PHASES):
            records.append(Record(pid, rank, step, PHASES[phase], since, limit, thread, started))
    return records


def signal_rank(record: Record, signum: int) -> bool:
    """Send `signum` to the rank's process if it is still the one that wrote `record`;
    False if it is gone."""
    return signal_process(record.pid, record.started, signum)


def rank_alive(record: Record) -> bool:
    """Whether the process that wrote `record` is still running (not merely its pid)."""
    return still_running(record.pid, record.started)


class PhaseLimits:
    """How long each phase may take: derived from its longest recent duration, or fixed."""

    def __init__(self, config: WatchdogConfig) -> None:
        self.config = config
        self.longest: dict[str, float] = {}
        self._bucket = [0.0, 0.0]  # the step maxima of this and the previous 100 steps
        self._steps = 0

    def observe(self, phase: str, seconds: float) -> None:
        if phase == STEP:
            self._steps += 1
            if self._steps % BUCKET_STEPS == 0:
                self._bucket = [0.0, self._bucket[0]]
            self._bucket[0] = max(self._bucket[0], seconds)
            self.longest[STEP] = max(self._bucket)
        else:
            self.longest[phase] = seconds  # rarer phases: the last one is the recent one

    def limit(self, phase: str) -> float:
        config = self.config
        if phase in (STARTUP, RESUME, DONE) or phase not in self.longest:
            return config.first_s
        if config.timeout_s != "auto":
            return float(config.timeout_s)
        return max(config.floor_s, config.multiple * self.longest[phase])


class Heartbeat:
    """This rank's record: `beat` at every step boundary, `phase` around the slow ones."""

    def __init__(self, folder: Path, rank: int, config: WatchdogConfig) -> None:
        self.folder, self.rank = folder, rank
        self.limits = PhaseLimits(config)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank-{rank}.beat"
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(descriptor, RECORD_BYTES)
            self._map = mmap.mmap(descriptor, RECORD_BYTES)
        finally:
            os.close(descriptor)
        self.path = path
        # appended to, so that a dump lands at the start of a file the watchdog emptied
        self._stacks = open(stack_file(folder, rank), "a")  # noqa: SIM115 - faulthandler keeps it
        faulthandler.register(STACK_SIGNAL, file=self._stacks, all_threads=True, chain=False)
        self._ids = (os.getpid(), rank)
        self._started = process_start(os.getpid())
        self._main = threading.main_thread().ident or 0
        self._writes = 0
        self.step, self.phase_name, self.since = 0, STARTUP, time.monotonic()
        self.explicit_limit_s: float | None = None  # the current phase's limit, when given
        self._write(self.limits.limit(STARTUP))

    def _write(self, limit: float) -> None:
        self._writes += 1
        phase = PHASES.index(self.phase_name)
        fields = (*self._ids, self.step, phase, self.since, limit, self._main, self._writes, self._started)
        _LAYOUT.pack_into(self._map, 0, *fields)

    def beat(self, step: int) -> None:
        """A step ended: the time since the last boundary is a step's (the first one after
        start-up, resume or a slow phase closes that phase instead)."""
        now = time.monotonic()
        self.limits.observe(self.phase_name, now - self.since)
        self.step, self.phase_name, self.since, self.explicit_limit_s = step, STEP, now, None
        self._write(self.limits.limit(STEP))

    def resumed_at(self, step: int) -> None:
        """The run goes on from `step`: the record's last step is that one, not 0, for the
        watchdog's report and for telling a crash that recurs at one step."""
        self.step = step
        limit = self.explicit_limit_s
        self._write(self.limits.limit(self.phase_name) if limit is None else limit)

    def enter(self, phase: str, limit_s: float | None = None) -> None:
        """From now on this rank is in `phase`, for at most `limit_s` (default: derived).
        A step cut short, or start-up, is no observation of its phase."""
        now = time.monotonic()
        if self.phase_name not in (STEP, STARTUP):
            self.limits.observe(self.phase_name, now - self.since)
        self.phase_name, self.since, self.explicit_limit_s = phase, now, limit_s
        self._write(self.limits.limit(phase) if limit_s is None else limit_s)

    @contextmanager
    def phase(self, phase: str, limit_s: float | None = None) -> Iterator[None]:
        """`phase` for the block's duration (observed), then back to the phase before it,
        with its limit, and its clock started again."""
        before, before_limit_s = self.phase_name, self.explicit_limit_s
        self.enter(phase, limit_s)
        try:
            yield
        finally:
            self.enter(before, before_limit_s)

    def close(self) -> None:
        """The rank is done: no limit applies any more, and its files go."""
        self.enter(DONE)
        faulthandler.unregister(STACK_SIGNAL)
        self._stacks.close()
        self._map.close()
        for leftover in (self.path, stack_file(self.folder, self.rank)):
            leftover.unlink(missing_ok=True)
