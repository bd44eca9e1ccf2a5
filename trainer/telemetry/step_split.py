"""A progress line's step split over all ranks, and which rank holds the others back."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from trainer.telemetry.timing import COMPUTE, DATA, PARTS


@dataclass(frozen=True)
class StepSplit:
    """Seconds per step in each part, the mean of each rank's own per-step figures, and the
    straggler: the rank whose busy time (its own data wait and compute, before the all-reduce
    makes every rank wait for the slowest) is furthest above the median rank's."""

    seconds: tuple[float, ...]
    straggler_lag: float
    slowest_rank: int

    @classmethod
    def of(cls, table: torch.Tensor) -> StepSplit:
        """From one row per rank: [timed steps, seconds in each of `PARTS`]. A rank that
        timed no step in the window (a GPU running behind) is left out."""
        timed = table[:, 0] > 0
        if not timed.any():
            return cls((0.0,) * len(PARTS), 0.0, 0)
        ranks = torch.nonzero(timed).flatten().tolist()
        per_step = table[timed, 1:] / table[timed, :1]
        lag, slowest = straggler_lag((per_step[:, DATA] + per_step[:, COMPUTE]).tolist())
        return cls(tuple(per_step.mean(0).tolist()), lag, ranks[slowest])

    @property
    def step_seconds(self) -> float:
        """The whole step: every part, checkpoint pauses and loop bookkeeping included."""
        return sum(self.seconds)

    @property
    def data_share(self) -> float:
        return self.seconds[DATA] / self.step_seconds if self.step_seconds else 0.0

    def milliseconds(self) -> dict[str, float]:
        """`step_ms` and `<part>_ms` for the progress line."""
        parts = {f"{name}_ms": seconds for name, seconds in zip(PARTS, self.seconds, strict=True)}
        return {
            name: round(1000 * seconds, 4)
            for name, seconds in {"step_ms": self.step_seconds, **parts}.items()
        }


def straggler_lag(busy_seconds: list[float]) -> tuple[float, int]:
    """(slowest / median - 1, slowest rank) over each rank's busy time."""
    median = statistics.median(busy_seconds)
    slowest = max(range(len(busy_seconds)), key=busy_seconds.__getitem__)
    return (busy_seconds[slowest] / median - 1.0 if median > 0 else 0.0), slowest
