"""Datasets, splits and the sharding every rank relies on."""

import gzip
import struct

import numpy as np
import pytest
import torch

from trainer.config import DataConfig, SyntheticConfig
from trainer.data import DataError, ResumableDistributedSampler, build_data
from trainer.data.digits import load_digits_arrays


def shards(dataset_size: int, world: int, epoch: int, start: int = 0) -> list[list[int]]:
    result = []
    for rank in range(world):
        sampler = ResumableDistributedSampler(range(dataset_size), num_replicas=world, rank=rank, seed=7)
        sampler.set_epoch(epoch)
        sampler.resume_at(start)
        result.append(list(sampler))
    return result


@pytest.mark.parametrize("world", [1, 2, 3])
def test_shards_are_disjoint_and_cover_the_epoch(world):
    parts = shards(101, world, epoch=0)
    flat = [i for part in parts for i in part]
    assert len(flat) == len(set(flat)) == (101 // world) * world
    assert all(len(part) == 101 // world for part in parts)
    assert set(flat) <= set(range(101))


def test_shuffles_differ_between_epochs_and_repeat_for_the_same_epoch():
    assert shards(64, 2, epoch=0) != shards(64, 2, epoch=1)
    assert shards(64, 2, epoch=3) == shards(64, 2, epoch=3)


def test_matches_torch_distributed_sampler_order():
    reference = torch.utils.data.DistributedSampler(range(50), num_replicas=2, rank=1, seed=7, drop_last=True)
    reference.set_epoch(4)
    assert shards(50, 2, epoch=4)[1] == list(reference)


def test_resume_at_same_world_size_continues_each_rank_exactly():
    full, consumed = shards(80, 2, epoch=2), 24
    resumed = shards(80, 2, epoch=2, start=consumed)
    for rank in range(2):
        assert resumed[rank] == full[rank][consumed // 2 :]


def test_resume_at_another_world_size_covers_the_rest_once():
    before = shards(90, 2, epoch=1)
    consumed_per_rank = 12
    seen = [i for part in before for i in part[:consumed_per_rank]]
    after = shards(90, 3, epoch=1, start=2 * consumed_per_rank)
    rest = [i for part in after for i in part]
    assert not set(seen) & set(rest)
    assert len(rest) == len(set(rest)) == 90 - len(seen)


def test_set_epoch_clears_a_resume_position():
    sampler = ResumableDistributedSampler(range(20), num_replicas=2, rank=0, seed=0)
    sampler.resume_at(10)
    assert len(sampler) == 5
    sampler.set_epoch(1)
    assert len(sampler) == 10


def test_digits_splits_are_disjoint_deterministic_and_independent_of_run_seed():
    config = DataConfig(name="digits")
    first, second = build_data(config, seed=1), build_data(config, seed=99)
    sizes = [len(first.train), len(first.val), len(first.test)]
    assert sum(sizes) == 1797 and min(sizes) > 200
    for split in ("train", "val", "test"):
        assert torch.equal(getattr(first, split).tensors[0], getattr(second, split).tensors[0])
    rows = {
        split: {tuple(x.flatten().tolist()) for x in getattr(first, split).tensors[0]}
        for split in ("val", "test")
    }
    train_rows = {tuple(x.flatten().tolist()) for x in first.train.tensors[0]}
    assert not rows["val"] & rows["test"]
    # digits holds a few exact duplicate images; overlap beyond those would mean leaked samples
    assert len(train_rows & rows["test"]) <= 3


def test_synthetic_tokens_are_next_token_targets():
    config = DataConfig(
        name="synthetic", synthetic=SyntheticConfig(kind="tokens", num_samples=64, seq_len=16)
    )
    splits = build_data(config, seed=0)
    inputs, targets = splits.train.tensors
    assert inputs.shape[1] == 16 and splits.spec.task == "language_modeling"
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert splits.spec.tokens_per_sample == 16


def test_synthetic_images_have_the_configured_shape():
    config = DataConfig(name="synthetic", synthetic=SyntheticConfig(channels=3, image_size=12, num_classes=5))
    splits = build_data(config, seed=0)
    assert splits.spec.input_shape == (3, 12, 12) and splits.spec.num_classes == 5
    assert splits.train.tensors[0].shape[1:] == (3, 12, 12)


def write_idx(path, array: np.ndarray, *, gz: bool, magic: int | None = None) -> None:
    header = struct.pack(">HBB", 0, 0x08, array.ndim) if magic is None else struct.pack(">I", magic)
    payload = header + struct.pack(f">{array.ndim}I", *array.shape) + array.astype(np.uint8).tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(payload))
    else:
        path.write_bytes(payload)


def make_mnist(folder, *, gz: bool, train: int = 40, test: int = 12) -> None:
    rng = np.random.default_rng(0)
    write_idx(folder / "train-images-idx3-ubyte", rng.integers(0, 256, (train, 28, 28)), gz=gz)
    write_idx(folder / "train-labels-idx1-ubyte", rng.integers(0, 10, (train,)), gz=gz)
    write_idx(folder / "t10k-images-idx3-ubyte", rng.integers(0, 256, (test, 28, 28)), gz=gz)
    write_idx(folder / "t10k-labels-idx1-ubyte", rng.integers(0, 10, (test,)), gz=gz)


@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gzip"])
def test_mnist_reads_idx_files(tmp_path, gz):
    make_mnist(tmp_path, gz=gz)
    splits = build_data(DataConfig(name="mnist", path=str(tmp_path), val_fraction=0.25), seed=0)
    assert splits.spec.input_shape == (1, 28, 28)
    assert (len(splits.train), len(splits.val), len(splits.test)) == (30, 10, 12)


def test_mnist_names_a_missing_file(tmp_path):
    make_mnist(tmp_path, gz=False)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DataError, match=r"t10k-labels-idx1-ubyte .*not found"):
        build_data(DataConfig(name="mnist", path=str(tmp_path)), seed=0)


def test_mnist_rejects_a_bad_magic_number(tmp_path):
    make_mnist(tmp_path, gz=False)
    write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((40, 28, 28)), gz=False, magic=0x00000801)
    with pytest.raises(DataError, match="bad IDX magic 00000801, expected 00000803"):
        build_data(DataConfig(name="mnist", path=str(tmp_path)), seed=0)


def test_mnist_rejects_a_truncated_body(tmp_path):
    make_mnist(tmp_path, gz=False)
    images = tmp_path / "train-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:-100])
    with pytest.raises(DataError, match="corrupt IDX"):
        build_data(DataConfig(name="mnist", path=str(tmp_path)), seed=0)


def test_mnist_rejects_a_corrupt_gzip(tmp_path):
    make_mnist(tmp_path, gz=True)
    images = tmp_path / "train-images-idx3-ubyte.gz"
    images.write_bytes(images.read_bytes()[:50])
    with pytest.raises(DataError, match="unreadable IDX"):
        build_data(DataConfig(name="mnist", path=str(tmp_path)), seed=0)


def test_mnist_rejects_mismatched_counts(tmp_path):
    make_mnist(tmp_path, gz=False)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(39), gz=False)
    with pytest.raises(DataError, match="40 images but 39 labels"):
        build_data(DataConfig(name="mnist", path=str(tmp_path)), seed=0)


def test_a_users_dataset_plugs_in_by_import_path():
    splits = build_data(DataConfig(name="plugins:slow_digits", options={"delay_s": 0}), seed=0)
    assert len(splits.train) > 1000


def test_a_plugin_must_return_splits():
    with pytest.raises(DataError, match="must return DataSplits"):
        build_data(DataConfig(name="plugins:not_splits"), seed=0)


def test_digits_read_from_scikit_learns_file_are_what_load_digits_returns():
    from sklearn.datasets import load_digits

    images, labels = load_digits_arrays()
    bunch = load_digits()
    assert np.array_equal(images, bunch.images) and np.array_equal(labels, bunch.target)
