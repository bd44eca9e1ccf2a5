"""DataLoaders for training (resumable, sharded) and evaluation (sharded, padding known)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from trainer.config import DataConfig
from trainer.data.sampler import ResumableDistributedSampler


def _loader_options(config: DataConfig, device: torch.device) -> dict:
    workers = config.num_workers
    options: dict = {
        "num_workers": workers,
        "pin_memory": config.pin_memory and device.type == "cuda",
    }
    if workers > 0:
        options["persistent_workers"] = config.persistent_workers
        options["prefetch_factor"] = config.prefetch_factor
    return options


def train_loader(
    dataset: Dataset,
    config: DataConfig,
    *,
    batch_size: int,
    rank: int,
    world_size: int,
    seed: int,
    device: torch.device,
) -> DataLoader:
    """Full batches only, so every optimizer step sees the same global batch.

    The loader gets a generator of its own: creating an iterator then never draws from the
    global RNG, which would otherwise shift dropout masks after a mid-epoch resume."""
    sampler = ResumableDistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=seed)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=True,
        generator=torch.Generator().manual_seed(seed),
        **_loader_options(config, device),
    )


def eval_loader(
    dataset: Dataset,
    config: DataConfig,
    *,
    batch_size: int,
    rank: int,
    world_size: int,
    device: torch.device,
    persistent: bool = False,
) -> DataLoader:
    """In order and padded by DistributedSampler; evaluation masks the padding out. A
    `persistent` loader (validation's, used every epoch) keeps its workers between
    evaluations as `data.persistent_workers` says, instead of starting them each time.

    A generator of its own, as the training loader's: each evaluation's iterator would
    otherwise draw from the global RNG, and training after it would see other dropout masks
    depending on where it ran (the world size of the round that validated an epoch's end)."""
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False, drop_last=False)
    options = _loader_options(config, device)
    if "persistent_workers" in options:
        options["persistent_workers"] = persistent and config.persistent_workers
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, generator=torch.Generator(), **options)
