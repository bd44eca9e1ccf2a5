"""`mnist`: the standard IDX files (raw or gzipped) from `data.path`, checked before use."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from trainer.config import DataConfig
from trainer.data.base import DataError, DataSpec, DataSplits
from trainer.data.splits import split_tensors, standardize

_UNSIGNED_BYTE = 0x08
FILES = {
    "train_images": ("train-images-idx3-ubyte", 3),
    "train_labels": ("train-labels-idx1-ubyte", 1),
    "test_images": ("t10k-images-idx3-ubyte", 3),
    "test_labels": ("t10k-labels-idx1-ubyte", 1),
}


def _find(folder: Path, stem: str) -> Path:
    for candidate in (folder / stem, folder / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    raise DataError("data.path", str(folder), f"{stem} (or {stem}.gz) not found there")


def read_idx(path: Path, expected_dims: int) -> np.ndarray:
    """Parse one IDX file of unsigned bytes, checking magic number, rank and length."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as handle:
            payload = handle.read()
    except (OSError, EOFError) as error:
        raise DataError("data.path", str(path), f"unreadable IDX file ({error})") from None
    if len(payload) < 4:
        raise DataError("data.path", str(path), "truncated IDX file (no header)")
    zero, dtype, dims = struct.unpack(">HBB", payload[:4])
    if zero != 0 or dtype != _UNSIGNED_BYTE or dims != expected_dims:
        magic = payload[:4].hex()
        wanted = f"0000080{expected_dims}"
        raise DataError("data.path", str(path), f"bad IDX magic {magic}, expected {wanted}")
    header = 4 + 4 * dims
    shape = struct.unpack(f">{dims}I", payload[4:header])
    if len(payload) - header != int(np.prod(shape)):
        raise DataError(
            "data.path",
            str(path),
            f"corrupt IDX: header says {shape}, body has {len(payload) - header} bytes",
        )
    return np.frombuffer(payload, dtype=np.uint8, offset=header).reshape(shape)


def _load_pair(folder: Path, images_key: str, labels_key: str) -> tuple[torch.Tensor, torch.Tensor]:
    images = read_idx(_find(folder, FILES[images_key][0]), FILES[images_key][1])
    labels = read_idx(_find(folder, FILES[labels_key][0]), FILES[labels_key][1])
    if len(images) != len(labels):
        raise DataError(
            "data.path", str(folder), f"{len(images)} images but {len(labels)} labels in {images_key}"
        )
    if labels.size and labels.max() > 9:
        raise DataError("data.path", str(folder), f"label {labels.max()} outside 0-9")
    pixels = torch.from_numpy(images.copy()).float().unsqueeze(1) / 255.0
    return pixels, torch.from_numpy(labels.astype(np.int64))


def build_mnist(config: DataConfig, seed: int) -> DataSplits:
    """Train and validation from the training files (cut by `data.val_fraction`); test is t10k."""
    folder = Path(config.path)
    if not config.path or not folder.is_dir():
        raise DataError("data.path", config.path, "must be a directory holding the MNIST IDX files")
    train_images, train_labels = _load_pair(folder, "train_images", "train_labels")
    test_images, test_labels = _load_pair(folder, "test_images", "test_labels")
    spec = DataSpec("classification", tuple(train_images.shape[1:]), 10)
    fit = split_tensors(
        standardize(train_images),
        train_labels,
        spec,
        val_fraction=config.val_fraction,
        test_fraction=0.0,
        split_seed=config.split_seed,
    )
    test = TensorDataset(standardize(test_images, reference=train_images), test_labels)
    return DataSplits(train=fit.train, val=fit.val, test=test, spec=spec)
