"""A data identity tells the data a checkpoint was trained on from other data, and the same
data from a copy of it: in-process, on the real datasets and the real shards writer."""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest
import torch
from torch.utils.data import Dataset

from trainer.checkpoint.manager import CheckpointError
from trainer.checkpoint.resume import data_changes
from trainer.config import DataConfig, ShardsConfig
from trainer.config.plugin_errors import PluginError
from trainer.data import build_data
from trainer.data.identity import DataIdentity, identify
from trainer.data.shards.write import main as shards_main


def identity_of(config: DataConfig) -> DataIdentity:
    return identify(config, build_data(config, seed=0))


def write_shards(folder, seed: int) -> str:
    command = ["write", "--config", "digits", "--to", str(folder), "--samples-per-shard", "200"]
    assert shards_main([*command, "--seed", str(seed)]) == 0
    return str(folder)


def shards(path: str, tmp_path) -> DataConfig:
    return DataConfig(name="shards", path=path, shards=ShardsConfig(cache_dir=str(tmp_path / "cache")))


def test_the_same_built_in_data_is_the_same_identity_and_a_resplit_is_not():
    digits = identity_of(DataConfig())
    assert identity_of(DataConfig()) == digits and digits.content.startswith("samples sha256 ")
    resplit = identity_of(DataConfig(split_seed=1))
    assert resplit.sizes == digits.sizes
    assert resplit.differences(digits) == [
        f"samples sha256 {digits.content[15:27]} -> samples sha256 {resplit.content[15:27]}",
        "data.split_seed 0 -> 1",
    ]
    regrouped = identity_of(DataConfig(val_fraction=0.2))
    assert "sizes train/val/test 1257/270/270 -> 1168/359/270" in regrouped.differences(digits)


def test_options_that_do_not_change_the_data_are_no_difference():
    plain = identity_of(DataConfig(name="plugins:recording_digits", options={"record_dir": "/tmp/a"}))
    moved = identity_of(DataConfig(name="plugins:recording_digits", options={"record_dir": "/tmp/b"}))
    assert moved.differences(plain) == [] and moved.options != plain.options


def test_rewritten_shards_differ_by_their_index_and_a_copy_elsewhere_is_the_same_data(tmp_path):
    first = identity_of(shards(write_shards(tmp_path / "v1", seed=0), tmp_path))
    assert first.content.startswith("index sha256 ")
    copy = shutil.copytree(tmp_path / "v1", tmp_path / "copy")
    assert identity_of(shards(str(copy), tmp_path)).differences(first) == []
    shutil.rmtree(tmp_path / "v1")
    rewritten = identity_of(shards(write_shards(tmp_path / "v1", seed=1), tmp_path))
    (difference,) = rewritten.differences(first)
    assert difference.startswith("index sha256 ") and rewritten.sizes == first.sizes


class Samples(Dataset):
    """A dataset of dict samples read only through __getitem__, with reads counted."""

    def __init__(self, values: list[float]) -> None:
        self.values, self.reads = values, 0

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, index: int) -> dict:
        self.reads += 1
        return {"inputs": torch.tensor([self.values[index]]), "target": index % 3}


class Versioned(Samples):
    def __init__(self, values: list[float], version: str) -> None:
        super().__init__(values)
        self.version = version

    def fingerprint(self) -> str:
        return self.version


def splits_of(train: Dataset) -> object:
    digits = build_data(DataConfig(), seed=0)
    return replace(digits, train=train, val=Samples([0.5] * 40), test=Samples([]))


def test_a_plugins_samples_are_read_through_getitem_and_its_fingerprint_replaces_them():
    config = DataConfig(name="plugins:own")
    train = Samples([float(i) for i in range(1000)])
    read = identify(config, splits_of(train))
    assert train.reads == 16 and read.sizes == [1000, 40, 0]
    train.values[999] = -1.0  # the last sample is always among those read
    assert identify(config, splits_of(train)).differences(read)
    versioned = Versioned([0.0] * 1000, "manifest etag 7f3e")
    named = identify(config, splits_of(versioned))
    assert named.content == "manifest etag 7f3e" and versioned.reads == 0
    again = identify(config, splits_of(Versioned([0.0] * 1000, "manifest etag 9a01")))
    assert again.differences(named) == ["manifest etag 7f3e -> manifest etag 9a01"]


def test_a_fingerprint_that_raises_is_the_plugins_one_line():
    class Broken(Samples):
        def fingerprint(self) -> str:
            return {"version": 1}["etag"]

    with pytest.raises(PluginError) as raised:
        identify(DataConfig(name="plugins:own"), splits_of(Broken([0.0] * 10)))
    line = str(raised.value)
    assert line.startswith("data.name='plugins:own': raised KeyError: 'etag' at ") and "\n" not in line
    assert "test_data_identity.py" in line and "in fingerprint" in line


def test_a_resume_on_other_data_is_refused_naming_the_ways_on_or_allowed_to_restart_the_epoch():
    saved = identity_of(DataConfig()).as_tree()
    now = identity_of(DataConfig(split_seed=1))
    config = DataConfig(split_seed=1)
    with pytest.raises(CheckpointError) as refused:
        data_changes(saved, now, config, step=25, epoch=2, uri="s3://bucket/run")
    line = str(refused.value)
    assert line.startswith("data.name='digits': step 25 in s3://bucket/run was trained on other data (")
    assert line.endswith(
        "restore that data to resume exactly, set data.on_change=restart_epoch to keep the weights and "
        "train epoch 2 again from its start on this data, or set checkpoint.uri elsewhere to start a new run"
    )
    with pytest.raises(CheckpointError, match=r"start a new run \(or remove checkpoints/digits-cnn\)$"):
        data_changes(saved, now, config, step=25, epoch=2, uri="checkpoints/digits-cnn")  # a laptop's
    with pytest.raises(CheckpointError, match="keep the weights and go on from epoch 3 on this data"):
        data_changes(saved, now, config, step=38, epoch=3, uri="x", mid_epoch=False)  # at an epoch's end
    restart = replace(config, on_change="restart_epoch")
    assert data_changes(saved, now, restart, step=25, epoch=2, uri="x") == now.differences(
        DataIdentity.from_tree(saved)
    )
    assert data_changes(saved, identity_of(DataConfig()), config, step=25, epoch=2, uri="x") == []
    assert data_changes(None, now, config, step=25, epoch=2, uri="x") == []  # an older checkpoint
