"""`digits`: scikit-learn's bundled 8x8 handwritten digits (1,797 images), no download."""

from __future__ import annotations

import torch

from trainer.config import DataConfig
from trainer.data.base import DATASETS, DataSpec, DataSplits
from trainer.data.splits import split_tensors, standardize


@DATASETS.register("digits")
def build_digits(config: DataConfig, seed: int) -> DataSplits:
    """Images as float (1, 8, 8) tensors, labels 0-9. scikit-learn is imported here, not at
    the top: it takes 1.8 s (scipy.stats), which every process importing the trainer
    (ddp-launch, a run on other data) would otherwise pay at each start."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1)
    labels = torch.tensor(bunch.target, dtype=torch.int64)
    spec = DataSpec(task="classification", input_shape=(1, 8, 8), num_classes=10)
    return split_tensors(
        standardize(images),
        labels,
        spec,
        val_fraction=config.val_fraction,
        test_fraction=config.test_fraction,
        split_seed=config.split_seed,
    )
