"""CPU time, measured from outside the contenders: a contender's process tree is sampled
while it runs, so that its CPU-seconds over its own steady windows can be set beside its
wall-clock rate. On two shared cores wall time swings with whatever else runs; CPU time
per sample swings far less, and it counts what wall time hides (a writer process, a
loader worker, the launcher's agent)."""

from __future__ import annotations

import bisect
import threading
import time

import psutil

POLL_S = 0.05


def tree_cpu_seconds(root: psutil.Process) -> float:
    """User + system seconds of `root` and every live descendant, and of the children
    each of them has already waited for."""
    total = 0.0
    for process in [root, *root.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.Error:  # it ended between the listing and the reading
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


class TreeCpuSampler:
    """Samples a process tree's CPU-seconds every `POLL_S` on a thread of its own, so that
    the CPU spent between two wall-clock times (`time.time()`, as the JSON progress
    lines stamp them) can be read afterwards by interpolation."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)
        self.times: list[float] = []
        self.cpu: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> TreeCpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                cpu = tree_cpu_seconds(self.root)
            except psutil.Error:  # the root has exited
                return
            self.times.append(time.time())
            self.cpu.append(cpu)
            self._stop.wait(POLL_S)

    def at(self, when: float) -> float:
        """The tree's CPU-seconds at wall time `when`, linearly between the two samples around it."""
        index = bisect.bisect_left(self.times, when)
        if index == 0:
            return self.cpu[0]
        if index == len(self.times):
            return self.cpu[-1]
        t0, t1 = self.times[index - 1], self.times[index]
        c0, c1 = self.cpu[index - 1], self.cpu[index]
        return c0 + (c1 - c0) * (when - t0) / (t1 - t0)

    def between(self, start: float, end: float) -> float:
        return self.at(end) - self.at(start)


def per_thousand(cpu_seconds: float, samples: int) -> float:
    """CPU-seconds per 1,000 samples."""
    return 1000 * cpu_seconds / samples
