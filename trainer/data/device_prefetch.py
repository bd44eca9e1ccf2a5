"""The next batch on its way to the GPU while the current step runs.

A batch from a pinned-memory loader copies to the device asynchronously, but on the
compute stream it still waits behind the step queued before it and the step after waits
for it. Issued on a side stream when the batch before it is handed out, the copy overlaps
that batch's step, as torchtitan and Lightning's prefetchers do; the compute stream waits
for the copy only when the batch is used, and `record_stream` keeps the caching allocator
from reusing the batch's memory while the side stream still owns it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

Batch = tuple[torch.Tensor, ...]


def on_device(batches: Iterator[Batch], device: torch.device) -> Iterator[Batch]:
    """`batches` copied one ahead on a side stream on CUDA; unchanged elsewhere (a CPU
    batch is already where the step reads it)."""
    if device.type != "cuda":
        return batches
    return _prefetched(batches, device)


def _prefetched(batches: Iterator[Batch], device: torch.device) -> Iterator[Batch]:
    stream = torch.cuda.Stream(device)

    def copy(batch: Batch) -> Batch:
        with torch.cuda.stream(stream):
            return tuple(tensor.to(device, non_blocking=True) for tensor in batch)

    compute = torch.cuda.current_stream(device)
    ahead = next(batches, None)
    ahead = None if ahead is None else copy(ahead)
    while ahead is not None:
        current = ahead
        compute.wait_stream(stream)  # before the next copy is queued: this one's only
        for tensor in current:
            tensor.record_stream(compute)
        following = next(batches, None)
        ahead = None if following is None else copy(following)  # overlaps `current`'s step
        yield current
