"""`data.name=shards`: a dataset of safetensors shards in a folder or under an S3 prefix,
streamed with exact resume (`dataset`), its index (`index`), where it is read from
(`source`), the node's cache (`cache`) and the tool that writes one (`write`,
`python -m trainer.data.shards`)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from trainer.config import DataConfig
from trainer.data.base import DataError, DataSplits
from trainer.data.shards.cache import ShardCache, default_cache_dir
from trainer.data.shards.dataset import ShardedDataset
from trainer.data.shards.index import INDEX_FILE, ShardIndex, parse_index
from trainer.data.shards.source import ShardSource, open_source


def build_shards(config: DataConfig, seed: int) -> DataSplits:
    """The dataset at `data.path`, its index read and every shard's presence and size checked
    before any step, so that a missing shard stops the run now, not hours in."""
    if config.num_workers:
        raise DataError(
            "data.num_workers", config.num_workers,
            "must be 0 for data.name=shards: its shards are read ahead by threads in the training "
            "process (data.shards.prefetch), and slicing a loaded shard needs no worker",
        )  # fmt: skip
    source = open_source(config.path)
    index_bytes = source.read(INDEX_FILE)
    index = parse_index(index_bytes, source.uri)
    check_listing(index, source)
    options = config.shards
    cache = ShardCache(
        Path(options.cache_dir) if options.cache_dir else default_cache_dir(),
        options.cache_mb * 2**20,
        source.uri,
    )

    fingerprint = f"index sha256 {hashlib.sha256(index_bytes).hexdigest()}"

    def split(entries) -> ShardedDataset:
        return ShardedDataset(
            entries, source, cache, block=options.block, prefetch=options.prefetch, fingerprint=fingerprint
        )

    return DataSplits(split(index.train), split(index.val), split(index.test), index.data_spec())


def check_listing(index: ShardIndex, source: ShardSource) -> None:
    """Each shard the index names is there at the size it gives (one listing, not a request
    per shard); the first that is not is named."""
    sizes = source.sizes()
    for entry in index.shards():
        size = sizes.get(entry.file)
        if size is None:
            raise DataError("data.path", source.uri, f"{entry.file} is missing (named in {INDEX_FILE})")
        if size != entry.bytes:
            raise DataError(
                "data.path",
                source.uri,
                f"{entry.file} is corrupt: {size} bytes, {INDEX_FILE} says {entry.bytes}",
            )
