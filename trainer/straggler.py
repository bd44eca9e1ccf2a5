"""Per-rank busy time, measured before the gradient all-reduce makes every rank wait for
the slowest, and the lag of the slowest rank behind the median.

No postponed annotations here: DDP checks the hook's `bucket` annotation at run time."""

import statistics
import time

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel


class BucketClock:
    """A DDP comm hook's state: when this rank's last gradient bucket became ready, which
    is when its own backward work ended and waiting for its peers began."""

    def __init__(self) -> None:
        self.last_ready: float | None = None

    def install(self, model: DistributedDataParallel) -> None:
        model.register_comm_hook(self, _timed_allreduce)

    def compute_since(self, started: float) -> float | None:
        """Seconds from `started` to the last bucket of the step; None if no bucket fired."""
        ready, self.last_ready = self.last_ready, None
        return None if ready is None else ready - started


def _timed_allreduce(
    clock: BucketClock, bucket: torch.distributed.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    clock.last_ready = time.perf_counter()
    return allreduce_hook(None, bucket)


def straggler_lag(busy_seconds: list[float]) -> tuple[float, int]:
    """(slowest / median - 1, slowest rank) over each rank's busy time."""
    median = statistics.median(busy_seconds)
    slowest = max(range(len(busy_seconds)), key=busy_seconds.__getitem__)
    return (busy_seconds[slowest] / median - 1.0 if median > 0 else 0.0), slowest
