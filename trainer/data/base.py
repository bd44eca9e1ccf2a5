"""What every dataset hands the trainer: three splits and a description of their shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch.utils.data import Dataset

from trainer.config import ConfigError

Task = Literal["classification", "language_modeling"]


class DataError(ConfigError):
    """Data that cannot be used as configured (missing or corrupt files, bad shapes)."""


@dataclass(frozen=True)
class DataSpec:
    """Enough about the data for a model to size itself and for metrics to count tokens."""

    task: Task
    input_shape: tuple[int, ...]
    num_classes: int
    tokens_per_sample: int = 1


@dataclass(frozen=True)
class DataSplits:
    """Train, validation and test sets of one dataset, disjoint by construction."""

    train: Dataset
    val: Dataset
    test: Dataset
    spec: DataSpec
