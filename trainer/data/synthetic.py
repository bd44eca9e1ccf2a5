"""`synthetic`: random images or a random token stream, for throughput work without I/O."""

from __future__ import annotations

import torch

from trainer.config import DataConfig, SyntheticConfig
from trainer.data.base import DataSpec, DataSplits
from trainer.data.splits import split_tensors


def synthetic_spec(shape: SyntheticConfig) -> DataSpec:
    """What `data.synthetic` makes, known without making it (`ddp-ops render` sizes from it)."""
    if shape.kind == "images":
        return DataSpec(
            "classification", (shape.channels, shape.image_size, shape.image_size), shape.num_classes
        )
    return DataSpec("language_modeling", (shape.seq_len,), shape.vocab_size, shape.seq_len)


def build_synthetic(config: DataConfig, seed: int) -> DataSplits:
    """`data.synthetic.kind=images`: (C, S, S) normal noise with random labels;
    `tokens`: windows of a uniform token stream, each target the next token."""
    shape = config.synthetic
    generator = torch.Generator().manual_seed(seed)
    if shape.kind == "images":
        size = (shape.num_samples, shape.channels, shape.image_size, shape.image_size)
        inputs = torch.randn(size, generator=generator)
        targets = torch.randint(shape.num_classes, (shape.num_samples,), generator=generator)
    else:
        stream = torch.randint(
            shape.vocab_size, (shape.num_samples * shape.seq_len + 1,), generator=generator
        )
        inputs = stream[:-1].view(shape.num_samples, shape.seq_len)
        targets = stream[1:].view(shape.num_samples, shape.seq_len)
    return split_tensors(
        inputs,
        targets,
        synthetic_spec(shape),
        val_fraction=config.val_fraction,
        test_fraction=config.test_fraction,
        split_seed=config.split_seed,
    )
