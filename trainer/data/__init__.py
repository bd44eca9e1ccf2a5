"""Datasets behind one registry, and the loaders that shard them over ranks."""

from trainer.config.registry import DATASETS
from trainer.data.base import DataError, DataSpec, DataSplits
from trainer.data.loading import eval_loader, train_loader
from trainer.data.sampler import ResumableDistributedSampler

__all__ = [
    "DATASETS",
    "DataError",
    "DataSpec",
    "DataSplits",
    "ResumableDistributedSampler",
    "build_data",
    "eval_loader",
    "train_loader",
]


def build_data(config, seed: int) -> DataSplits:
    """The configured dataset's splits; plug-ins are `package.module:function(config, seed)`."""
    splits = DATASETS.build(config.name, config, seed)
    if not isinstance(splits, DataSplits):
        raise DataError("data.name", config.name, "a dataset builder must return DataSplits")
    if len(splits.train) == 0 or len(splits.val) == 0:
        raise DataError("data.name", config.name, "train and validation splits must not be empty")
    return splits
