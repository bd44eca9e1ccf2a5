"""Where a start's time goes, from the container's start to the end of the first step.

Each phase ends at a mark the run makes as it gets there; the first begins at the start's
origin: `ddp-launch`'s own start (it puts it in `TRAINER_STARTED_AT` for its torchrun's
workers), close to the container's start; without ddp-launch, the torchrun agent's that
started this worker; in a process torchrun restarted (or run alone), its own start. So
the phases tile the time to the first step:
  launch and rendezvous  origin -> this process started (torchrun's import and rendezvous)
  imports                -> the trainer's main (torch and the trainer's modules)
  data and model         -> data built, the model probed, the store opened
  process group          -> the group formed
  resume                 -> the checkpoint or snapshot restored (and the model compiled,
                            in place, which is cheap: the compile itself is the first step's)
  first step             -> the first optimizer step done (with train.compile, its compile)
Rank 0 logs them in one line after the first step and every rank exports them
(`ddp_startup_seconds{phase}`). The pod's own phases before the container (scheduling, the
image pull) are in its status, which `ddp-ops status` reads.
"""

from __future__ import annotations

import os
import time

import psutil

STARTED_AT_ENV = "TRAINER_STARTED_AT"
AGENTS = ("torch.distributed.run", "torchrun")  # a worker's parent, where torchrun started it
PHASES = ("launch and rendezvous", "imports", "data and model", "process group", "resume", "first step")


def started_at(pid: int) -> float:
    """When process `pid` started, on the wall clock. psutil's `create_time` adds the ticks
    since boot to the boot time, which Linux gives in whole seconds (/proc/stat's btime): up
    to a second off. Its age (/proc/uptime less its start in ticks, one clock) is not."""
    try:
        with open("/proc/uptime") as uptime, open(f"/proc/{pid}/stat") as stat:
            since_boot = float(uptime.read().split()[0])
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        return time.time() - (since_boot - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):  # no /proc (a laptop's macOS)
        return psutil.Process(pid).create_time()


def origin(restart_count: int) -> float:
    """When this start began (see the module's docstring)."""
    if restart_count == 0:
        if given := os.environ.get(STARTED_AT_ENV):
            return float(given)
        try:
            parent = psutil.Process().parent()
            if parent is not None and any(agent in " ".join(parent.cmdline()) for agent in AGENTS):
                return started_at(parent.pid)
        except psutil.Error:
            pass
    return started_at(os.getpid())


class StartupSplit:
    """The marks of one process's start; `mark` is cheap, `parts` reads them. The process's
    own start is read there too, not at import: a worker forked by the fork server imported
    this module in the server, long before it was started."""

    def __init__(self) -> None:
        self.marks: dict[str, float] = {}

    @property
    def reported(self) -> bool:
        """Whether the first step has ended (and the split was said)."""
        return "first step" in self.marks

    def mark(self, phase: str) -> None:
        """`phase` ends now; the first mark of a name holds."""
        self.marks.setdefault(phase, time.time())

    def parts(self, restart_count: int) -> list[tuple[str, float]]:
        """(phase, seconds) for each phase marked, in order; a phase not marked (a run that
        restores nothing marks `resume` all the same) is folded into the next."""
        edges = [("launch and rendezvous", started_at(os.getpid()))]
        edges += [(phase, self.marks[phase]) for phase in PHASES[1:] if phase in self.marks]
        began = origin(restart_count)
        parts = []
        for phase, ended in edges:
            parts.append((phase, max(0.0, ended - began)))
            began = max(began, ended)
        return parts


def describe(parts: list[tuple[str, float]], compiled: bool) -> str:
    total = sum(seconds for _, seconds in parts)
    said = ", ".join(
        f"{phase}{' (compiling)' * (compiled and phase == 'first step')} {seconds:.1f}s"
        for phase, seconds in parts
    )
    return f"start-up {total:.1f}s to the first step: {said}"


STARTUP = StartupSplit()  # this process's; marked from the trainer's entry point on
