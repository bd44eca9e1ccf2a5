"""`shards`: a map-style dataset over safetensors shards, read ahead in the order a rank
will need them.

Exactness comes from the trainer's sampler (`trainer.data.sampler`), unchanged: one global
order per epoch, dealt to ranks by position, so resume and resize are exact as for any
dataset. This dataset only shapes that order (`epoch_order`) so that reads are local: the
shards are shuffled, then the samples of each run of `block` shards, which keeps a rank on
`block` shards at a time whatever the world size. The sampler hands each rank's sequence of
samples over (`plan_reads`); from it the dataset knows which shards come next and fetches
the next `prefetch` of them on as many threads while the current ones are read.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from torch.utils.data import Dataset

from trainer.data.base import DataError
from trainer.data.shards.cache import ShardCache
from trainer.data.shards.index import ShardEntry
from trainer.data.shards.source import ShardSource

Tensors = tuple[torch.Tensor, torch.Tensor]


class ShardedDataset(Dataset):
    def __init__(
        self,
        entries: Sequence[ShardEntry],
        source: ShardSource,
        cache: ShardCache,
        *,
        block: int,
        prefetch: int,
        fingerprint: str,
    ) -> None:
        """`fingerprint`: the index's digest, which names every shard's bytes."""
        self.entries, self.source, self.cache = list(entries), source, cache
        self._fingerprint = fingerprint
        self.block, self.prefetch = block, prefetch
        self.starts = [0]
        for entry in self.entries:
            self.starts.append(self.starts[-1] + entry.samples)
        self._plan: list[int] = list(range(len(self.entries)))  # shards in the order they come
        self._place = {shard: place for place, shard in enumerate(self._plan)}
        self._loaded: dict[int, Future[Tensors]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=prefetch, thread_name_prefix="shard-fetch")
        self._current = -1

    def __len__(self) -> int:
        return self.starts[-1]

    def fingerprint(self) -> str:
        """What the data is (`trainer.data.identity`): the index's sha256, without a read."""
        return self._fingerprint

    def epoch_order(self, seed: int) -> list[int]:
        """This epoch's global order: shards shuffled, then samples within each block."""
        generator = torch.Generator().manual_seed(seed)
        shards = torch.randperm(len(self.entries), generator=generator).tolist()
        order = []
        for first in range(0, len(shards), self.block):
            members = torch.cat(
                [torch.arange(self.starts[s], self.starts[s + 1]) for s in shards[first : first + self.block]]
            )
            order.append(members[torch.randperm(len(members), generator=generator)])
        return torch.cat(order).tolist()

    def plan_reads(self, indices: Sequence[int]) -> None:
        """The samples this rank reads next, in order: what to fetch ahead."""
        plan, seen = [], set()
        for index in indices:
            shard = self.shard_of(index)
            if shard not in seen:
                seen.add(shard)
                plan.append(shard)
        with self._lock:
            self._plan, self._place, self._current = plan, {s: p for p, s in enumerate(plan)}, -1

    def shard_of(self, index: int) -> int:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} outside the dataset's {len(self)}")
        return bisect.bisect_right(self.starts, index) - 1

    def __getitem__(self, index: int) -> Tensors:
        shard = self.shard_of(index)
        inputs, targets = self._shard(shard).result()
        offset = index - self.starts[shard]
        return inputs[offset], targets[offset]

    def __getitems__(self, indices: Sequence[int]) -> list[Tensors]:
        """A batch (DataLoader's batched fetch): each shard it spans looked up once."""
        shards = [self.shard_of(index) for index in indices]
        loaded = {shard: self._shard(shard).result() for shard in dict.fromkeys(shards)}
        batch = []
        for index, shard in zip(indices, shards, strict=True):
            inputs, targets = loaded[shard]
            batch.append((inputs[index - self.starts[shard]], targets[index - self.starts[shard]]))
        return batch

    def _shard(self, shard: int) -> Future[Tensors]:
        """The shard's tensors (a future). The first read of a shard further along the plan
        than any before moves the window: the next `block + prefetch` shards requested,
        those more than a block behind released. Within a block a rank goes back and forth
        between its shards; the window moves only forward."""
        with self._lock:
            place = self._place.get(shard, -1)
            if place > self._current:
                self._current = place
                ahead = self._plan[place : place + self.block + self.prefetch]
                keep = set(self._plan[max(0, place - self.block) : place]) | set(ahead)
                for old in [s for s in self._loaded if s not in keep]:
                    del self._loaded[old]
                for upcoming in ahead:
                    self._request(upcoming)
            return self._request(shard)

    def _request(self, shard: int) -> Future[Tensors]:
        if shard not in self._loaded:
            self._loaded[shard] = self._pool.submit(self._load, shard)
        return self._loaded[shard]

    def _load(self, shard: int) -> Tensors:
        entry = self.entries[shard]
        data = self.cache.get(entry, self.source.read)
        try:
            tensors = load_safetensors(data)
        except SafetensorError as error:
            raise DataError(
                "data.path", self.source.uri, f"{entry.file} is not a safetensors file ({error})"
            ) from None
        inputs, targets = tensors.get("inputs"), tensors.get("targets")
        if inputs is None or targets is None or len(inputs) != entry.samples or len(targets) != entry.samples:
            raise DataError(
                "data.path",
                self.source.uri,
                f"{entry.file} must hold inputs and targets of {entry.samples} samples",
            )
        return inputs, targets
