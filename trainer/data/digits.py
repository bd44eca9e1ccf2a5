"""`digits`: scikit-learn's bundled 8x8 handwritten digits (1,797 images), no download."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch

from trainer.config import DataConfig
from trainer.data.base import DataSpec, DataSplits
from trainer.data.splits import split_tensors, standardize


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """Images (1797, 8, 8) and labels, from the CSV that scikit-learn ships and its
    `load_digits` reads. Importing scikit-learn costs 1.8 s (scipy.stats), which every
    start and restart of every rank would pay; so the file is found without importing the
    package (`find_spec` does not run it), and `load_digits` is only the fallback."""
    spec = importlib.util.find_spec("sklearn")
    locations = spec.submodule_search_locations if spec is not None else None
    csv = Path(locations[0]) / "datasets" / "data" / "digits.csv.gz" if locations else None
    if csv is not None and csv.is_file():
        raw = np.loadtxt(csv, delimiter=",")
        return raw[:, :-1].reshape(-1, 8, 8), raw[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return bunch.images, bunch.target


DIGITS_SPEC = DataSpec(task="classification", input_shape=(1, 8, 8), num_classes=10)


def build_digits(config: DataConfig, seed: int) -> DataSplits:
    """Images as float (1, 8, 8) tensors, labels 0-9."""
    images, targets = load_digits_arrays()
    pixels = torch.tensor(images, dtype=torch.float32).unsqueeze(1)
    labels = torch.tensor(targets, dtype=torch.int64)
    return split_tensors(
        standardize(pixels),
        labels,
        DIGITS_SPEC,
        val_fraction=config.val_fraction,
        test_fraction=config.test_fraction,
        split_seed=config.split_seed,
    )
