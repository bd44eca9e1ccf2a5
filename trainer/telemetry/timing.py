"""Where each second of training goes: the step split into parts that tile it.

The loop calls `lap(part)` at each boundary: the time since the previous lap belongs to
`part`. Laps are contiguous, so every second between two steps' ends lands in exactly one
part (or in none, for validation, which is not training). Two clocks keep the laps:

- `HostClock` reads `perf_counter`. On a CPU the host does the work it times, so it is exact.
- `CudaClock` records CUDA events on the current stream and reads them only once the GPU
  has passed them (`resolved`), so timing never stalls the step. With NCCL the host does
  not wait for the all-reduce (DDP's finalize makes the stream wait), and with amp off or
  bf16 nothing syncs the host each step: host timestamps would put peers' lateness and the
  log step's syncs wherever the host happens to block. On the device's own timeline, an
  interval is what the GPU spent between two boundaries, idle gaps included: time the host
  made it wait for data lands in `data`, a stalled log step in `logging`.

A step's laps: its leading bookkeeping (`logging`, `checkpoint` for a save, none for
validation), `data` once its micro-batches are fetched, `compute` when its backward work
ends (a hook on the parameter whose gradient comes last) and again after the optimizer,
`communication` when the backward returns with the gradients all-reduced: only the part of
the all-reduce that overlapping could not hide, peers' lateness included.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch
from torch import nn

PARTS = ("data", "compute", "communication", "checkpoint", "logging")
DATA, COMPUTE, COMMUNICATION, CHECKPOINT, LOGGING = range(len(PARTS))

StepSeconds = list[float]
"""One step's seconds per part, in `PARTS` order."""


class StepClock(Protocol):
    """Laps of the training loop, resolved into per-step seconds per part."""

    def lap(self, part: int | None) -> None:
        """The time since the previous lap belongs to `part` (None: to no step)."""

    def end_step(self) -> None:
        """The step's last lap is taken; later laps belong to the next step."""

    def resolved(self, *, wait: bool = False) -> list[StepSeconds]:
        """Ended steps whose time is known, oldest first, each once. With `wait`, all ended
        steps (blocking until the device has finished them)."""


class HostClock:
    """Laps on the host's `perf_counter`."""

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self._open: StepSeconds = [0.0] * len(PARTS)
        self._ended: list[StepSeconds] = []

    def lap(self, part: int | None) -> None:
        now = time.perf_counter()
        if part is not None:
            self._open[part] += now - self._last
        self._last = now

    def end_step(self) -> None:
        self._ended.append(self._open)
        self._open = [0.0] * len(PARTS)

    def resolved(self, *, wait: bool = False) -> list[StepSeconds]:
        ended, self._ended = self._ended, []
        return ended


class CudaClock:
    """Laps as CUDA events on the current stream, read once the GPU has passed them."""

    def __init__(self) -> None:
        self._last = self._record()
        self._open: list[tuple[int | None, torch.cuda.Event]] = []
        self._ended: deque[tuple[torch.cuda.Event, list[tuple[int | None, torch.cuda.Event]]]] = deque()

    @staticmethod
    def _record() -> torch.cuda.Event:
        mark = torch.cuda.Event(enable_timing=True)
        mark.record()
        return mark

    def lap(self, part: int | None) -> None:
        self._open.append((part, self._record()))

    def end_step(self) -> None:
        self._ended.append((self._last, self._open))
        self._last, self._open = self._open[-1][1], []

    def resolved(self, *, wait: bool = False) -> list[StepSeconds]:
        steps: list[StepSeconds] = []
        while self._ended:
            origin, laps = self._ended[0]
            if wait:
                laps[-1][1].synchronize()
            elif not laps[-1][1].query():
                break
            seconds = [0.0] * len(PARTS)
            previous = origin
            for part, mark in laps:
                if part is not None:
                    seconds[part] += previous.elapsed_time(mark) / 1000  # milliseconds
                previous = mark
            steps.append(seconds)
            self._ended.popleft()
        return steps


def clock_for(device: torch.device) -> StepClock:
    """Device time on CUDA, the host's clock elsewhere."""
    return CudaClock() if device.type == "cuda" else HostClock()


def lap_when_backward_ends(module: nn.Module, clock: StepClock) -> None:
    """Lap `compute` when this rank's own backward work ends, before it waits for peers.

    A hook on the first parameter, which (registered input-first, as models are) gets its
    gradient last: one cheap Python call per backward. A DDP comm hook would see each
    bucket too, but replacing DDP's C++ all-reduce with a Python one cost ~6% of a small
    model's step in our measurements."""
    first = next((p for p in module.parameters() if p.requires_grad), None)
    if first is not None:
        first.register_post_accumulate_grad_hook(lambda _: clock.lap(COMPUTE))


@contextmanager
def lapped(clock: StepClock, part: int | None) -> Iterator[None]:
    """The block's time belongs to `part`; the bookkeeping before it to `logging`."""
    clock.lap(LOGGING)
    try:
        yield
    finally:
        clock.lap(part)
