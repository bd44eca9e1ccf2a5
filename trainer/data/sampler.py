"""A DistributedSampler that can start an epoch part-way through, for exact mid-epoch resume.

Rank r of W reads positions r, r+W, r+2W, ... of one global order per epoch, so after each
rank has read m samples the first m*W positions are consumed, whatever W was. Resuming at
global position p shards the rest of the same order over the current world size: the epoch
still visits every sample once, even when the world size changed.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Dataset, DistributedSampler


class ResumableDistributedSampler(DistributedSampler):
    """`set_epoch` starts a fresh epoch; `resume_at` skips the first positions of this one."""

    def __init__(self, dataset: Dataset, *, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        self.start_position = 0

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.start_position = 0

    def resume_at(self, position: int) -> None:
        """Skip the first `position` samples of this epoch's global order. A position past
        this world size's epoch (saved by fewer ranks, which drop fewer samples) is its end."""
        if position < 0:
            raise ValueError(f"resume position {position} is negative")
        self.start_position = min(position, self.total_size)

    def global_order(self) -> list[int]:
        """This epoch's order over all ranks (the one DistributedSampler deals from), or the
        dataset's own (`epoch_order(seed)`: one that keeps reads local, as shards do); either
        depends on the seed and epoch only, never on the world size."""
        if hasattr(self.dataset, "epoch_order"):
            return self.dataset.epoch_order(self.seed + self.epoch)[: self.total_size]
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.dataset), generator=generator)[: self.total_size].tolist()

    def _remaining(self) -> int:
        return (self.total_size - self.start_position) // self.num_replicas

    def __iter__(self) -> Iterator[int]:
        rest = self.global_order()[self.start_position :]
        mine = rest[self.rank : self._remaining() * self.num_replicas : self.num_replicas]
        if hasattr(self.dataset, "plan_reads"):  # what it fetches ahead
            self.dataset.plan_reads(mine)
        return iter(mine)

    def __len__(self) -> int:
        return self._remaining()
