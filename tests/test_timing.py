"""The step split: laps that tile a step on the host clock (and on CUDA events where there is
a GPU), the hook that marks the end of a rank's own backward, and the cross-rank accounting
behind a progress line's split and straggler."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from trainer.telemetry.step_split import StepSplit
from trainer.telemetry.timing import (
    CHECKPOINT,
    COMMUNICATION,
    COMPUTE,
    DATA,
    LOGGING,
    PARTS,
    CudaClock,
    HostClock,
    lap_when_backward_ends,
    lapped,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Stopwatch:
    """The test's own clock around each lap: a lap's instant lies between the readings just
    before and just after its call, so a part's time is bracketed however loaded the machine
    (no nominal sleep length is assumed)."""

    def __init__(self, clock: HostClock) -> None:
        self.clock, self.marks = clock, []

    def lap(self, part: int | None) -> None:
        before = time.perf_counter()
        self.clock.lap(part)
        self.marks.append((before, time.perf_counter()))

    def between(self, first: int, last: int) -> tuple[float, float]:
        """The least and most time that can lie between lap `first` and lap `last`."""
        return self.marks[last][0] - self.marks[first][1], self.marks[last][1] - self.marks[first][0]


def bracketed(value: float, bounds: tuple[float, float]) -> bool:
    return bounds[0] - 1e-9 <= value <= bounds[1] + 1e-9


def test_host_laps_tile_each_step_and_leave_validation_out():
    clock = HostClock()
    watch = Stopwatch(clock)
    began = time.perf_counter()
    clock.lap(None)  # the set-up is no step's
    set_up = time.perf_counter()
    inner, outer = [], []  # each validation, timed inside and around its exclusion
    for _ in range(2):
        watch.lap(LOGGING)  # marks 0 and 4: the step's start
        time.sleep(0.02)
        watch.lap(DATA)
        time.sleep(0.03)
        watch.lap(COMPUTE)
        clock.end_step()
        around = time.perf_counter()
        with lapped(clock, None):  # validation: no step's time
            within = time.perf_counter()
            time.sleep(0.05)
            inner.append(time.perf_counter() - within)
        outer.append(time.perf_counter() - around)
        before = time.perf_counter()
        with lapped(clock, CHECKPOINT):
            time.sleep(0.01)
        watch.marks.append((before, time.perf_counter()))  # the save's bracket
    watch.lap(LOGGING)
    clock.end_step()
    wall = time.perf_counter() - began
    first, second, last = clock.resolved()
    assert clock.resolved() == []  # each step once
    assert bracketed(first[DATA], watch.between(0, 1)) and bracketed(first[COMPUTE], watch.between(1, 2))
    assert bracketed(second[DATA], watch.between(4, 5)) and bracketed(second[COMPUTE], watch.between(5, 6))
    assert first[CHECKPOINT] == 0 and 0 < second[CHECKPOINT] <= watch.marks[3][1] - watch.marks[3][0]
    timed = sum(map(sum, (first, second, last)))  # the steps tile the run, validation left out
    assert watch.marks[8][0] - set_up - sum(outer) <= timed <= wall - sum(inner)


def test_the_hook_marks_the_end_of_backward_and_the_wait_after_it_is_communication():
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
    clock = HostClock()
    lap_when_backward_ends(model, clock)
    clock.lap(DATA)
    started = time.perf_counter()
    model(torch.randn(512, 64)).sum().backward()
    backward = time.perf_counter() - started
    waited = time.perf_counter()
    time.sleep(0.04)  # a peer still busy: the all-reduce would wait here
    waited = time.perf_counter() - waited
    clock.lap(COMMUNICATION)
    ended = time.perf_counter()
    clock.end_step()
    (step,) = clock.resolved()
    assert 0 < step[COMPUTE] <= backward + 1e-3  # backward's end is marked inside backward()
    assert waited <= step[COMMUNICATION] <= ended - started  # the wait, and nothing before backward


def test_split_is_the_mean_of_each_ranks_own_steps_and_names_the_straggler():
    # rows: [timed steps, data, compute, communication, checkpoint, logging] in seconds
    table = torch.tensor(
        [
            [10, 0.10, 1.00, 0.50, 0.02, 0.01],  # waits for rank 2 in the all-reduce
            [0, 0.00, 0.00, 0.00, 0.00, 0.00],  # its GPU ran behind: nothing timed yet
            [8, 0.08, 1.20, 0.00, 0.016, 0.008],  # the straggler: more of its own work per step
            [10, 0.10, 1.00, 0.50, 0.02, 0.01],
        ],
        dtype=torch.float64,
    )
    split = StepSplit.of(table)
    per_step = [(0.01 + 0.01 + 0.01) / 3, (0.1 + 0.15 + 0.1) / 3, (0.05 + 0 + 0.05) / 3, 0.002, 0.001]
    assert split.seconds == pytest.approx(per_step)
    assert split.slowest_rank == 2
    assert split.straggler_lag == pytest.approx(0.16 / 0.11 - 1)
    ms = split.milliseconds()
    assert ms["step_ms"] == pytest.approx(1000 * (0.03 + 0.35 + 0.1) / 3 + 3, abs=1e-3)  # by hand
    assert split.data_share == pytest.approx(per_step[DATA] / sum(per_step))


def test_split_of_a_window_nobody_timed_is_empty():
    split = StepSplit.of(torch.zeros(2, 1 + len(PARTS), dtype=torch.float64))
    assert split.step_seconds == 0 and split.data_share == 0 and split.slowest_rank == 0


class StandInEvent:
    """A stand-in for torch.cuda.Event on this CPU-only machine (no CUDA device can run
    here): `record` stamps a time the test chooses, and the event counts as passed only once
    the test says the "GPU" got there, as `query` and `synchronize` would tell."""

    clock = 0.0
    passed_until = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.stamp: float | None = None

    def record(self) -> None:
        self.stamp = StandInEvent.clock

    def query(self) -> bool:
        return self.stamp is not None and self.stamp <= StandInEvent.passed_until

    def synchronize(self) -> None:
        StandInEvent.passed_until = max(StandInEvent.passed_until, self.stamp)

    def elapsed_time(self, end: StandInEvent) -> float:
        assert self.query() and end.query(), "elapsed_time of an event the GPU has not passed"
        return 1000 * (end.stamp - self.stamp)


def test_cuda_clock_reads_only_steps_the_device_has_passed(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", StandInEvent)
    StandInEvent.clock = StandInEvent.passed_until = 0.0
    clock = CudaClock()
    for _ in range(3):
        for part, seconds in ((LOGGING, 0.001), (DATA, 0.002), (COMPUTE, 0.010), (COMMUNICATION, 0.003)):
            StandInEvent.clock += seconds
            clock.lap(part)
        clock.end_step()
    assert clock.resolved() == []  # the host queued three steps; the device has done none
    StandInEvent.passed_until = 0.032 + 1e-9  # the device finished two
    first, second = clock.resolved()
    assert second == pytest.approx([0.002, 0.010, 0.003, 0.0, 0.001])
    assert sum(first) == pytest.approx(0.016)
    assert clock.resolved() == []
    (third,) = clock.resolved(wait=True)  # the run's end waits for the rest
    assert sum(third) == pytest.approx(0.016)


@pytest.mark.gpu
@needs_cuda
def test_cuda_laps_are_device_time_read_without_waiting():
    """The GPU's own timeline: a lap recorded while the GPU is still busy is read only once
    it has passed, and the parts tile the device time between the first and last lap."""
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    clock = CudaClock()
    clock.lap(LOGGING)
    time.sleep(0.05)  # the host is late with data: the GPU idles
    clock.lap(DATA)
    for _ in range(20):
        a = a @ a / a.norm()
    clock.lap(COMPUTE)
    clock.end_step()
    assert clock.resolved() == []  # the matmuls are still running: nothing to read yet
    (step,) = clock.resolved(wait=True)
    assert step[DATA] == pytest.approx(0.05, abs=0.02)
    assert step[COMPUTE] > 0.001
    assert clock.resolved(wait=True) == []
