"""Sharded datasets (`data.name=shards`): written by the shard tool, read from a folder or from
moto's S3 over HTTP, in an order that every world size deals out exactly once, through a
node cache of bounded size; a missing, damaged or mis-indexed shard is one error naming it."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import S3Bucket

from trainer.config import DataConfig, ShardsConfig, load_config
from trainer.data import DataError, ResumableDistributedSampler, build_data
from trainer.data.shards.cache import ShardCache
from trainer.data.shards.index import INDEX_FILE, parse_index
from trainer.data.shards.source import LocalSource, open_source
from trainer.data.shards.write import main as shards_main
from trainer.data.shards.write import write_dataset

PER_SHARD = 100


@pytest.fixture(scope="module")
def digits_shards(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("shards") / "digits"
    assert (
        shards_main(
            ["write", "--config", "digits", "--to", str(folder), "--samples-per-shard", str(PER_SHARD)]
        )
        == 0
    )
    return folder


def shards_config(path, tmp_path: Path, **options) -> DataConfig:
    shards = ShardsConfig(cache_dir=str(tmp_path / "cache"), **options)
    return DataConfig(name="shards", path=str(path), shards=shards)


def rows(dataset) -> set[bytes]:
    """Each sample's inputs and target as bytes: what a split holds, whatever the order."""
    return {x.numpy().tobytes() + bytes([int(y)]) for x, y in (dataset[i] for i in range(len(dataset)))}


def test_the_shards_hold_every_sample_of_each_split_once(digits_shards, tmp_path):
    bundled = build_data(load_config("digits").data, 0)
    sharded = build_data(shards_config(digits_shards, tmp_path), 0)
    for name in ("train", "val", "test"):
        ours, theirs = getattr(sharded, name), getattr(bundled, name)
        assert len(ours) == len(theirs) and rows(ours) == rows(theirs), name
    assert sharded.spec == bundled.spec
    assert len(sharded.train.entries) == -(-len(bundled.train) // PER_SHARD)


def test_an_epoch_order_is_a_permutation_local_to_blocks_and_set_by_the_seed(digits_shards, tmp_path):
    train = build_data(shards_config(digits_shards, tmp_path, block=3), 0).train
    order = train.epoch_order(7)
    assert sorted(order) == list(range(len(train)))
    assert order == train.epoch_order(7) and order != train.epoch_order(8)
    first_block = {train.shard_of(index) for index in order[: 3 * PER_SHARD]}
    assert len(first_block) == 3  # the first 300 positions come from 3 shards, not all 13


@pytest.mark.parametrize("before, after", [(2, 2), (2, 1), (1, 3)])
def test_a_resumed_epoch_covers_the_rest_exactly_once_at_any_world_size(
    digits_shards, tmp_path, before, after
):
    """Positions dealt at `before` ranks up to a mid-epoch position, the rest at `after`:
    every sample of the epoch's order once (up to the tail each world size drops)."""
    train = build_data(shards_config(digits_shards, tmp_path), 0).train

    def deal(world: int, start: int) -> list[list[int]]:
        samplers = [
            ResumableDistributedSampler(train, num_replicas=world, rank=r, seed=3) for r in range(world)
        ]
        for sampler in samplers:
            sampler.set_epoch(1)
            sampler.resume_at(start)
        return [list(sampler) for sampler in samplers]

    position = 2 * 320  # 320 samples read by each of 2 ranks, or 640 by one
    first = [ranks[: position // before] for ranks in deal(before, 0)]
    rest = deal(after, position)
    seen = [index for ranks in first + rest for index in ranks]
    assert len(seen) == len(set(seen))
    order = train.epoch_order(3 + 1)
    assert set(seen) == set(order[: position + len(rest[0]) * after])


def test_the_sampler_tells_the_dataset_what_to_fetch_ahead(digits_shards, tmp_path):
    train = build_data(shards_config(digits_shards, tmp_path, block=2, prefetch=2), 0).train
    sampler = ResumableDistributedSampler(train, num_replicas=2, rank=1, seed=0)
    mine = list(sampler)
    assert train._plan[0] == train.shard_of(mine[0])
    train[mine[0]]
    assert set(train._plan[:4]) <= set(train._loaded)  # its block, and the next 2 shards, requested


def test_a_missing_shard_is_named_before_any_step(digits_shards, tmp_path):
    copy = tmp_path / "copy"
    write_dataset(build_data(load_config("digits").data, 0), open_source(str(copy), create=True),
                  samples_per_shard=PER_SHARD, seed=0)  # fmt: skip
    (copy / "train" / "00004.safetensors").unlink()
    with pytest.raises(DataError, match=r"train/00004\.safetensors is missing \(named in index\.json\)"):
        build_data(shards_config(copy, tmp_path), 0)


def test_a_damaged_shard_is_named_when_read_and_never_cached(digits_shards, tmp_path):
    copy = tmp_path / "copy"
    write_dataset(build_data(load_config("digits").data, 0), open_source(str(copy), create=True),
                  samples_per_shard=PER_SHARD, seed=0)  # fmt: skip
    damaged = copy / "train" / "00002.safetensors"
    data = bytearray(damaged.read_bytes())
    data[-5] ^= 0xFF  # same size: only the sha256 can tell
    damaged.write_bytes(bytes(data))
    train = build_data(shards_config(copy, tmp_path), 0).train
    with pytest.raises(
        DataError, match=r"train/00002\.safetensors is corrupt: its sha256 differs from the index"
    ):
        train[train.starts[2]]
    assert train[0][0].shape == (1, 8, 8)  # the others still read
    cached = {path.name for path in (tmp_path / "cache").iterdir()}
    assert train.entries[2].sha256 not in cached


def test_an_index_that_breaks_the_format_is_one_line_naming_the_field(digits_shards):
    index = json.loads((digits_shards / INDEX_FILE).read_text())
    index["train"][1]["samples"] = 0
    with pytest.raises(DataError, match=r"index\.json: train\.1\.samples: Input should be greater than 0"):
        parse_index(json.dumps(index).encode(), "somewhere")
    with pytest.raises(
        DataError, match=r"data.path='/nowhere'.*must be an s3:// prefix or a folder of shards"
    ):
        build_data(DataConfig(name="shards", path="/nowhere"), 0)


def test_loader_workers_are_refused_for_shards(digits_shards, tmp_path):
    config = shards_config(digits_shards, tmp_path)
    config.num_workers = 2
    with pytest.raises(DataError, match=r"data.num_workers=2: must be 0 for data.name=shards"):
        build_data(config, 0)


def test_the_node_cache_stays_within_its_bound_and_serves_what_it_holds(digits_shards, tmp_path):
    index = parse_index((digits_shards / INDEX_FILE).read_bytes(), "here")
    limit = 3 * index.train[0].bytes + 10
    cache = ShardCache(tmp_path / "cache", limit, "here")
    source = LocalSource(digits_shards)
    for entry in index.train:
        assert cache.get(entry, source.read) == (digits_shards / entry.file).read_bytes()
        assert sum(path.stat().st_size for path in cache.folder.iterdir()) <= limit
    newest = index.train[-1]

    def unreachable(name: str) -> bytes:
        raise AssertionError(f"{name} was fetched though the cache holds it")

    assert cache.get(newest, unreachable) == (digits_shards / newest.file).read_bytes()


def test_a_folder_of_npy_files_becomes_a_dataset(tmp_path):
    rng = np.random.default_rng(0)
    for label in ("cat", "dog"):
        (tmp_path / "files" / label).mkdir(parents=True)
        for n in range(30):
            np.save(tmp_path / "files" / label / f"{n}.npy", rng.normal(size=(3, 4)).astype(np.float32))
    out = tmp_path / "out"
    assert shards_main(["write", "--from-folder", str(tmp_path / "files"), "--to", str(out)]) == 0
    splits = build_data(shards_config(out, tmp_path), 0)
    assert splits.spec.input_shape == (3, 4) and splits.spec.num_classes == 2
    assert len(splits.train) + len(splits.val) + len(splits.test) == 60
    (tmp_path / "files" / "dog" / "bad.npy").write_bytes(b"not an array")
    assert shards_main(["write", "--from-folder", str(tmp_path / "files"), "--to", str(out)]) == 2


def test_shards_in_s3_read_as_from_a_folder(digits_shards, tmp_path, s3_bucket: S3Bucket):
    for path in digits_shards.rglob("*"):
        if path.is_file():
            key = f"data/digits/{path.relative_to(digits_shards)}"
            s3_bucket.client.put_object(Bucket=s3_bucket.name, Key=key, Body=path.read_bytes())
    from_s3 = build_data(shards_config(s3_bucket.uri("data/digits"), tmp_path), 0)
    from_folder = build_data(shards_config(digits_shards, tmp_path / "other"), 0)
    for index in (0, 555, len(from_s3.train) - 1):
        assert torch.equal(from_s3.train[index][0], from_folder.train[index][0])
    s3_bucket.client.delete_object(Bucket=s3_bucket.name, Key="data/digits/val/00001.safetensors")
    with pytest.raises(DataError, match=r"val/00001\.safetensors is missing"):
        build_data(shards_config(s3_bucket.uri("data/digits"), tmp_path), 0)


def test_the_ranks_of_a_node_fetch_a_shard_once(digits_shards, tmp_path):
    """Four readers at once (each its own open of the lock file, as each rank's process has):
    one fetches, the others wait on the shard's lock and read what it wrote."""
    index = parse_index((digits_shards / INDEX_FILE).read_bytes(), "here")
    entry, fetched = index.train[0], []

    def slow_fetch(name: str) -> bytes:
        fetched.append(name)
        time.sleep(0.3)
        return (digits_shards / name).read_bytes()

    caches = [ShardCache(tmp_path / "cache", 2**20, "here") for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda cache: cache.get(entry, slow_fetch), caches))
    assert fetched == [entry.file]
    assert all(result == (digits_shards / entry.file).read_bytes() for result in results)
