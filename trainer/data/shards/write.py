"""`python -m trainer.data.shards write`: a dataset's shards and index, from the trainer's own
datasets (`--config digits`, any `--set data...`) or from a folder of `.npy` files, one
subfolder per class; to a folder or an S3 prefix (the standard AWS chain, as for training).

Samples are shuffled once (`--seed`) before they are cut into shards, so that no shard holds
one class; the index goes last, so a dataset with an index is complete.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save as save_safetensors
from torch.utils.data import Dataset

from trainer.config import ConfigError
from trainer.config.argparsing import OneLineParser
from trainer.data.base import DataError, DataSpec, DataSplits
from trainer.data.shards.index import FORMAT, INDEX_FILE, SPLITS, describe
from trainer.data.shards.source import ShardSource, open_source
from trainer.data.splits import split_tensors


def write_dataset(splits: DataSplits, target: ShardSource, *, samples_per_shard: int, seed: int) -> dict:
    """Every split's shards, then the index; the index's content."""
    spec = splits.spec
    index: dict = {
        "format": FORMAT,
        "spec": {
            "task": spec.task,
            "input_shape": list(spec.input_shape),
            "num_classes": spec.num_classes,
            "tokens_per_sample": spec.tokens_per_sample,
        },
    }
    for number, name in enumerate(SPLITS):
        inputs, targets = _stack(getattr(splits, name))
        order = torch.randperm(len(inputs), generator=torch.Generator().manual_seed(seed + number))
        entries = []
        for count, first in enumerate(range(0, len(order), samples_per_shard)):
            chosen = order[first : first + samples_per_shard]
            data = save_safetensors(
                {"inputs": inputs[chosen].contiguous(), "targets": targets[chosen].contiguous()}
            )
            file = f"{name}/{count:05d}.safetensors"
            target.write(file, data)
            size, sha256 = describe(data)
            entries.append({"file": file, "samples": len(chosen), "bytes": size, "sha256": sha256})
        index[name] = entries
    target.write(INDEX_FILE, (json.dumps(index, indent=1) + "\n").encode())
    return index


def _stack(dataset: Dataset) -> tuple[torch.Tensor, torch.Tensor]:
    tensors = getattr(dataset, "tensors", None)  # a TensorDataset: no copy per sample
    if tensors is not None and len(tensors) == 2:
        return tensors[0], tensors[1]
    pairs = [dataset[i] for i in range(len(dataset))]
    return torch.stack([torch.as_tensor(x) for x, _ in pairs]), torch.as_tensor([y for _, y in pairs])


def folder_splits(folder: Path, *, val_fraction: float, test_fraction: float, split_seed: int) -> DataSplits:
    """Splits of `folder/<class>/<file>.npy`, classes numbered in sorted order of their names."""
    classes = sorted(path for path in folder.iterdir() if path.is_dir()) if folder.is_dir() else []
    if not classes:
        raise DataError("--from-folder", str(folder), "must hold one subfolder of .npy files per class")
    arrays, labels = [], []
    for label, class_folder in enumerate(classes):
        for file in sorted(class_folder.glob("*.npy")):
            try:
                arrays.append(np.load(file, allow_pickle=False))
            except (OSError, ValueError) as error:
                raise DataError("--from-folder", str(file), f"is not a .npy array ({error})") from None
            labels.append(label)
    shapes = {array.shape for array in arrays}
    if len(shapes) != 1:
        raise DataError(
            "--from-folder", str(folder), f"every array must have one shape; found {sorted(shapes)}"
        )
    inputs = torch.from_numpy(np.stack(arrays)).float()
    spec = DataSpec("classification", tuple(inputs.shape[1:]), len(classes))
    return split_tensors(
        inputs,
        torch.tensor(labels),
        spec,
        val_fraction=val_fraction,
        test_fraction=test_fraction,
        split_seed=split_seed,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m trainer.data.shards", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    write = commands.add_parser("write", help="write a dataset's shards and index")
    source = write.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="a bundled config or YAML file whose data section is written")
    source.add_argument("--from-folder", type=Path, help="a folder of <class>/<file>.npy")
    write.add_argument(
        "--set", action="append", default=[], help="overrides of that config (data.name=mnist,...)"
    )
    write.add_argument("--to", required=True, help="a folder or s3://bucket/prefix")
    write.add_argument("--samples-per-shard", type=int, default=256)
    write.add_argument("--seed", type=int, default=0, help="the shuffle before the cut into shards")
    args = parser.parse_args(argv)
    if args.samples_per_shard < 1:
        parser.error(f"--samples-per-shard {args.samples_per_shard}: must be 1 or more")
    try:
        splits = _splits(args)
        index = write_dataset(
            splits,
            open_source(args.to, create=True),
            samples_per_shard=args.samples_per_shard,
            seed=args.seed,
        )
    except ConfigError as error:
        sys.stderr.write(f"shards: error: {error}\n")
        return 2
    counts = ", ".join(
        f"{name} {sum(e['samples'] for e in index[name])} in {len(index[name])}" for name in SPLITS
    )
    print(f"wrote {args.to}: samples (and shards) {counts}")
    return 0


def _splits(args) -> DataSplits:
    from trainer.config import load_config
    from trainer.data import build_data

    if args.from_folder is not None:
        data = load_config(None, args.set).data
        return folder_splits(
            args.from_folder,
            val_fraction=data.val_fraction,
            test_fraction=data.test_fraction,
            split_seed=data.split_seed,
        )
    config = load_config(args.config, args.set)
    if config.data.name == "shards":
        raise DataError("data.name", "shards", "is what this tool writes; name the dataset to write from")
    return build_data(config.data, config.seed)
