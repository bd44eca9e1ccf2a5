"""`data.name=wave_classifier.data:build_dataset`: which of four frequencies a noisy wave has.

A dataset plug-in is `builder(config: DataConfig, seed: int) -> DataSplits`. Its own options
come from `data.options` (here `samples` and `length`); the split follows `data.val_fraction`,
`data.test_fraction` and `data.split_seed`, so every rank builds the same splits.
"""

from __future__ import annotations

import math

import torch

from trainer.config import DataConfig
from trainer.data.base import DataSpec, DataSplits
from trainer.data.splits import split_tensors

FREQUENCIES = (1.0, 2.0, 3.0, 5.0)  # cycles per window: the four classes


def build_dataset(config: DataConfig, seed: int) -> DataSplits:
    samples = int(config.options.get("samples", 2048))
    length = int(config.options.get("length", 64))
    generator = torch.Generator().manual_seed(config.split_seed)  # the data, not the run
    labels = torch.randint(len(FREQUENCIES), (samples,), generator=generator)
    phase = torch.rand(samples, 1, generator=generator) * 2 * math.pi
    time = torch.linspace(0, 1, length).unsqueeze(0)
    frequency = torch.tensor(FREQUENCIES)[labels].unsqueeze(1)
    waves = torch.sin(2 * math.pi * frequency * time + phase)
    waves += 0.3 * torch.randn(samples, length, generator=generator)
    spec = DataSpec("classification", (1, length), len(FREQUENCIES))
    return split_tensors(
        waves.unsqueeze(1),
        labels,
        spec,
        val_fraction=config.val_fraction,
        test_fraction=config.test_fraction,
        split_seed=config.split_seed,
    )
