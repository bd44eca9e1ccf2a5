"""Plug-ins the trainer loads by import path in tests (`data.name=plugins:slow_digits`).

They wrap the real digits data: one slows reading down so a test can kill a worker
mid-run, one records which sample indices each rank reads, one fails on one sample; a
model can make one rank a straggler, or stall one rank's step and slow every evaluation
down."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

from torch import nn
from torch.utils.data import Dataset

from trainer.config import DataConfig, ModelConfig
from trainer.data.base import DataSpec, DataSplits
from trainer.data.digits import build_digits
from trainer.data.shards import build_shards


class Through(Dataset):
    """A dataset read through another: what the wrapper does not define is the inner one's
    (a sharded dataset's `epoch_order` and `plan_reads`, which the sampler looks for)."""

    def __init__(self, inner: Dataset) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str):
        if name == "inner" or name.startswith("__"):  # not set yet (unpickling); DataLoader's
            raise AttributeError(name)  # __getitems__ would read past the wrapper
        return getattr(self.inner, name)


class SlowDataset(Through):
    def __init__(self, inner: Dataset, delay_s: float) -> None:
        super().__init__(inner)
        self.delay_s = delay_s

    def __getitem__(self, index: int):
        time.sleep(self.delay_s)
        return self.inner[index]


class RecordingDataset(Through):
    def __init__(self, inner: Dataset, record: Path) -> None:
        super().__init__(inner)
        self.record = record

    def __getitem__(self, index: int):
        with open(self.record, "a") as handle:
            handle.write(f"{index}\n")
        return self.inner[index]


class PoisonedDataset(Through):
    """Reading sample `bad_index` raises, every time: a record that cannot be read (OSError),
    or a bug in the reading code (KeyError: a field the record lacks)."""

    def __init__(self, inner: Dataset, bad_index: int, error: str) -> None:
        super().__init__(inner)
        self.bad_index, self.error = bad_index, error

    def __getitem__(self, index: int):
        if index == self.bad_index and self.error == "KeyError":
            return {"pixels": self.inner[index][0]}["label"]
        if index == self.bad_index:
            raise OSError(f"sample {index} is unreadable")
        return self.inner[index]


def poisoned_digits(config: DataConfig, seed: int) -> DataSplits:
    splits = build_digits(config, seed)
    bad, error = int(config.options["bad_index"]), config.options.get("error", "OSError")
    return replace(splits, train=PoisonedDataset(splits.train, bad, error))


def slow_digits(config: DataConfig, seed: int) -> DataSplits:
    splits = build_digits(config, seed)
    return replace(splits, train=SlowDataset(splits.train, float(config.options.get("delay_s", 0.001))))


def recording_digits(config: DataConfig, seed: int) -> DataSplits:
    return _recorded(build_digits(config, seed), config)


def _recorded(splits: DataSplits, config: DataConfig) -> DataSplits:
    folder = Path(config.options["record_dir"])
    folder.mkdir(parents=True, exist_ok=True)  # a pod's own /tmp starts empty
    record = folder / f"rank{os.environ.get('RANK', '0')}.txt"
    return replace(splits, train=RecordingDataset(splits.train, record))


def seen_shards(config: DataConfig, seed: int) -> DataSplits:
    """`data.name=shards`, each training read `delay_s` slower, and recorded per rank under
    `record_dir` when that option is given."""
    splits = build_shards(config, seed)
    splits = replace(splits, train=SlowDataset(splits.train, float(config.options.get("delay_s", 0))))
    return _recorded(splits, config) if "record_dir" in config.options else splits


def linear_model(config: ModelConfig, spec: DataSpec) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, spec.num_classes))


def not_splits(config: DataConfig, seed: int) -> list:
    return [1, 2, 3]


def wrong_signature(config: ModelConfig) -> nn.Module:  # the registry calls (config, spec)
    return nn.Linear(64, 10)


class SlowOnOneRank(nn.Module):
    """The linear model, with `delay_s` of extra work per forward on rank `rank` alone."""

    def __init__(self, inner: nn.Module, rank: int, delay_s: float) -> None:
        super().__init__()
        self.inner = inner
        self.delay_s = delay_s if int(os.environ.get("RANK", "0")) == rank else 0.0

    def forward(self, inputs):
        time.sleep(self.delay_s)
        return self.inner(inputs)


def straggler_model(config: ModelConfig, spec: DataSpec) -> nn.Module:
    options = config.options
    return SlowOnOneRank(linear_model(config, spec), int(options["rank"]), float(options["delay_s"]))


class Stalling(nn.Module):
    """The linear model, whose `stall_at`-th training forward on rank `rank` sleeps for
    `stall_s` in the first generation of workers only (a deadlock, a stuck kernel), and
    whose every evaluation forward sleeps `eval_delay_s` (a slow validation)."""

    def __init__(self, inner: nn.Module, options: dict) -> None:
        super().__init__()
        self.inner = inner
        first_generation = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        stalls = first_generation and int(os.environ.get("RANK", "0")) == int(options.get("rank", -1))
        self.stall_at = int(options.get("stall_at", 0)) if stalls else 0
        self.stall_s = float(options.get("stall_s", 0))
        self.eval_delay_s = float(options.get("eval_delay_s", 0))
        self.forwards = 0

    def forward(self, inputs):
        if self.training:
            self.forwards += 1
            if self.forwards == self.stall_at:
                time.sleep(self.stall_s)
        else:
            time.sleep(self.eval_delay_s)
        return self.inner(inputs)


def stalling_model(config: ModelConfig, spec: DataSpec) -> nn.Module:
    return Stalling(linear_model(config, spec), config.options)
