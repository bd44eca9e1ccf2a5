"""Which data a run trains on, recorded in every checkpoint and compared at a resume.

A resume continues the interrupted epoch in the order the sampler deals, and that order
depends on the data's length alone: on other data of the same length it would go on
silently, the epoch's samples seen twice or never. So each checkpoint records the data's
identity, taken at start without reading the data through:
- a dataset that can say what it is gives `fingerprint()` (the sharded dataset: its index's
  sha256, which lists every shard's sha256; a plug-in: a manifest's digest, a version id);
- otherwise a sha256 of a few samples spread over each split, read from the tensors of a
  TensorDataset (the built-ins) or through `__getitem__`;
- and always the splits' sizes.
Where the data lives (`data.path`) is recorded, not compared: a copied set is the same data.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from trainer.config import DataConfig
from trainer.config.registry import DATASETS
from trainer.data.base import DataSplits

SAMPLES_PER_SPLIT = 16  # read at start: 48 small reads, under a millisecond in memory
SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class DataIdentity:
    """What a checkpoint records of its data. `content` names its own kind: `index sha256
    ...`, a plug-in's fingerprint, or `samples sha256 ...`."""

    name: str
    options: dict[str, Any]
    split_seed: int
    location: str
    sizes: list[int]  # train, val, test
    content: str

    def as_tree(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_tree(cls, tree: Mapping[str, Any]) -> DataIdentity:
        return cls(**tree)

    def differences(self, saved: DataIdentity) -> list[str]:
        """What differs from the data `saved` was trained on (`what old -> new`); empty when
        it is the same data. Settings are named only as the likely cause of a difference."""
        found = []
        if saved.content != self.content:
            found.append(f"{short(saved.content)} -> {short(self.content)}")
        if saved.sizes != self.sizes:
            sizes = lambda identity: "/".join(map(str, identity.sizes))  # noqa: E731
            found.append(f"sizes train/val/test {sizes(saved)} -> {sizes(self)}")
        if found:
            for key in ("name", "split_seed", "options"):
                if getattr(saved, key) != getattr(self, key):
                    found.append(f"data.{key} {getattr(saved, key)!r} -> {getattr(self, key)!r}")
        return found


def identify(config: DataConfig, splits: DataSplits) -> DataIdentity:
    """This run's data identity; a plug-in's exception while it is taken is its one line."""
    datasets = [getattr(splits, split) for split in SPLITS]
    with DATASETS.calling(config.name):
        fingerprint = getattr(splits.train, "fingerprint", None)
        content = str(fingerprint()) if callable(fingerprint) else samples_digest(datasets)
    return DataIdentity(
        name=config.name,
        options=dict(config.options),
        split_seed=config.split_seed,
        location=config.path,
        sizes=[len(dataset) for dataset in datasets],
        content=content,
    )


def samples_digest(datasets: list[Dataset]) -> str:
    digest = hashlib.sha256()
    for dataset in datasets:
        tensors = getattr(dataset, "tensors", None)  # a TensorDataset, or one read through it
        in_memory = isinstance(tensors, tuple) and all(isinstance(t, torch.Tensor) for t in tensors)
        for index in spread(len(dataset)):
            feed(digest, tuple(t[index] for t in tensors) if in_memory else dataset[index])
    return f"samples sha256 {digest.hexdigest()}"


def spread(count: int) -> list[int]:
    """Up to SAMPLES_PER_SPLIT indices evenly over `count`, the first and the last among them."""
    if count == 0:  # an empty test split
        return []
    return sorted({round(i * (count - 1) / (SAMPLES_PER_SPLIT - 1)) for i in range(SAMPLES_PER_SPLIT)})


def feed(digest: Any, value: Any) -> None:
    """`value`'s bytes, dtype and shape into `digest`: tensors, arrays, numbers, strings and
    containers of them; any other object by its type's name alone."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().contiguous()
        digest.update(f"{value.dtype}{tuple(value.shape)}".encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, np.ndarray):
        digest.update(f"{value.dtype}{value.shape}".encode())
        digest.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, Mapping):
        for key in sorted(value, key=str):
            feed(digest, key)
            feed(digest, value[key])
    elif isinstance(value, list | tuple):
        digest.update(f"{type(value).__name__}{len(value)}".encode())
        for item in value:
            feed(digest, item)
    elif value is None or isinstance(value, bool | int | float | complex | str | bytes):
        digest.update(repr(value).encode())
    else:
        digest.update(type(value).__qualname__.encode())


def short(content: str) -> str:
    """`kind hexdigest` cut to a dozen digits, enough to tell two apart in a line."""
    kind, _, value = content.rpartition(" ")
    if kind and len(value) > 12:
        return f"{kind} {value[:12]}"
    return content if len(content) <= 40 else f"{content[:39]}…"
