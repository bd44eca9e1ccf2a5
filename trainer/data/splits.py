"""Deterministic train/validation/test splits of in-memory tensors."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from trainer.data.base import DataSpec, DataSplits


def split_tensors(
    inputs: torch.Tensor,
    targets: torch.Tensor,
    spec: DataSpec,
    *,
    val_fraction: float,
    test_fraction: float,
    split_seed: int,
) -> DataSplits:
    """Shuffle once with `split_seed` (never the run seed, so splits stay put across runs)
    and cut test, then validation, then train."""
    count = len(inputs)
    order = torch.randperm(count, generator=torch.Generator().manual_seed(split_seed))
    n_test = round(count * test_fraction)
    n_val = max(1, round(count * val_fraction))
    test, val, train = order[:n_test], order[n_test : n_test + n_val], order[n_test + n_val :]
    return DataSplits(
        train=TensorDataset(inputs[train], targets[train]),
        val=TensorDataset(inputs[val], targets[val]),
        test=TensorDataset(inputs[test], targets[test]),
        spec=spec,
    )


def standardize(images: torch.Tensor, reference: torch.Tensor | None = None) -> torch.Tensor:
    """Zero mean, unit variance, using the statistics of `reference` (default: `images`)."""
    reference = images if reference is None else reference
    return (images - reference.mean()) / reference.std().clamp_min(1e-6)
