"""What a save costs a training loop (`benchmarks.state_size`): a compute loop that saves
once and goes on until the writer is idle, against the loop undisturbed, the save done in
the background and inline, interleaved."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks.checkpoint import LoopRun, compute_loop
from trainer.checkpoint.writer import CheckpointWriter


@dataclass(frozen=True)
class Loop:
    """The compute loop a save runs beside: its matrix, steps at least, the undisturbed
    baseline's steps, and the most interleaved repeats of a size."""

    matrix: int = 1024  # ~40 ms steps on one thread, as benchmarks.checkpoint's
    steps: int = 20
    baseline_steps: int = 60
    repeats: int = 5


FULL_LOOP = Loop()
QUICK_LOOP = Loop(matrix=256, steps=5, baseline_steps=10, repeats=1)  # the suite's run: figures aside


@dataclass(frozen=True)
class SaveRun:
    blocked_s: float
    stall_s: float
    done_s: float  # save call to the write's end


def stall(run: LoopRun, mean_step: float) -> float:
    """What a save cost the loop: the wall time of its steps, the save call's included, over
    as many steps of the undisturbed loop (its mean: a long write's many steps would add up
    the positive half of the steps' jitter, a floor that grows with the write's length)."""
    return run.blocked + sum(run.durations) - len(run.durations) * mean_step


def undisturbed_step(loop: Loop) -> float:
    """The loop's mean step with nothing else at work: a second's pause first (the last
    save's upload may still keep moto busy), then 60 steps, the slowest 5 % left out (one
    hiccup in the baseline, multiplied by a long write's steps, would read as a negative
    stall)."""
    time.sleep(1.0)
    durations = sorted(compute_loop(loop.matrix, loop.baseline_steps).durations)
    return statistics.mean(durations[: int(len(durations) * 0.95)])


def timed_save(
    writer: CheckpointWriter, state: dict, step: int, durable: bool, mean_step: float, loop: Loop
) -> SaveRun:
    """One save in a compute loop, going on until the writer is idle: its blocked time
    (taken around the call), its stall, and when its write ended."""
    marks: dict[str, float] = {}

    def save() -> None:
        marks["saved"] = time.perf_counter()
        writer.save(state, step=step, epoch=0, world_size=1, durable=durable)

    def done() -> bool:
        if writer.wait(timeout=0):
            marks.setdefault("done", time.perf_counter())
            return True
        return False

    run = compute_loop(loop.matrix, loop.steps, save, until=done)
    marks.setdefault("done", time.perf_counter())
    return SaveRun(run.blocked, stall(run, mean_step), marks["done"] - marks["saved"])


def compare(
    make_writer: Callable[[bool], CheckpointWriter], state: dict, durable: bool, loop: Loop
) -> tuple[SaveRun, float]:
    """Background saves (after one that lays out the shared buffer, as a run's first does)
    and the same saves inline, interleaved: the median background run and stall ratio."""
    background, inline = make_writer(True), make_writer(False)
    runs, ratios = [], []
    try:
        background.save(state, step=1, epoch=0, world_size=1, durable=durable)
        background.wait(600)
        repeats = repeats_at(state, loop)
        for repeat in range(repeats):
            mean_step = undisturbed_step(loop)
            runs.append(timed_save(background, state, 2 + 2 * repeat, durable, mean_step, loop))
            synchronous = timed_save(inline, state, 3 + 2 * repeat, durable, mean_step, loop)
            ratios.append(runs[-1].stall_s / synchronous.stall_s)
    finally:
        background.close(600)
        inline.close(600)
    middle = sorted(range(repeats), key=lambda index: ratios[index])[repeats // 2]
    return runs[middle], ratios[middle]


def repeats_at(state: dict, loop: Loop) -> int:
    """Five interleaved repeats below half a gigabyte (short saves, noisy ratios), three below
    a gigabyte, one above (a 4 GB upload to moto takes minutes); at most the loop's."""
    size = sum(tensor.nbytes for tensor in tensors_of(state))
    return min(loop.repeats, 5 if size < 0.5e9 else 3 if size < 1e9 else 1)


def tensors_of(state: dict) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def walk(value: object) -> None:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)

    walk(state)
    return found
