"""What recording a checkpoint's data identity adds to a start, per bundled dataset.

    python -m benchmarks.data_identity [--repeats 5]

Each dataset is built as a rank builds it (`build_data`), then its identity taken
(`trainer.data.identity.identify`) `--repeats` times; printed: the build's time, the
identity's median and its share of the build. MNIST reads idx files of MNIST's full size
(70,000 images), written with random pixels into a temporary folder; shards are the digits
written by `python -m trainer.data.shards write`. Target: at most 50 ms for each.
"""

from __future__ import annotations

import argparse
import statistics
import struct
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from trainer.config import DataConfig, ShardsConfig, SyntheticConfig
from trainer.data import build_data
from trainer.data.identity import identify
from trainer.data.shards.write import main as write_shards


def write_mnist(folder: Path) -> None:
    """Idx files of MNIST's shapes, random pixels and labels."""
    rng = np.random.default_rng(0)
    for stem, shape, values in (
        ("train-images-idx3-ubyte", (60_000, 28, 28), 256),
        ("train-labels-idx1-ubyte", (60_000,), 10),
        ("t10k-images-idx3-ubyte", (10_000, 28, 28), 256),
        ("t10k-labels-idx1-ubyte", (10_000,), 10),
    ):
        header = struct.pack(">HBB", 0, 0x08, len(shape)) + struct.pack(f">{len(shape)}I", *shape)
        (folder / stem).write_bytes(header + rng.integers(0, values, shape, dtype=np.uint8).tobytes())


def datasets(folder: Path) -> dict[str, DataConfig]:
    (folder / "mnist").mkdir()
    write_mnist(folder / "mnist")
    shards = folder / "shards"
    write_shards(["write", "--config", "digits", "--to", str(shards), "--samples-per-shard", "200"])
    return {
        "digits": DataConfig(),
        "mnist": DataConfig(name="mnist", path=str(folder / "mnist")),
        "synthetic images": DataConfig(name="synthetic"),
        "synthetic tokens": DataConfig(name="synthetic", synthetic=SyntheticConfig(kind="tokens")),
        "shards": DataConfig(
            name="shards", path=str(shards), shards=ShardsConfig(cache_dir=str(folder / "cache"))
        ),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"{'dataset':<18} {'build ms':>9} {'identity ms':>12} {'of build':>9}")
    with tempfile.TemporaryDirectory() as folder:
        for name, config in datasets(Path(folder)).items():
            started = time.perf_counter()
            splits = build_data(config, seed=0)
            built = time.perf_counter() - started
            times = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                identify(config, splits)
                times.append(time.perf_counter() - started)
            identity = statistics.median(times)
            print(f"{name:<18} {built * 1e3:>9.1f} {identity * 1e3:>12.2f} {identity / built:>9.2%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
