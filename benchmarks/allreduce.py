"""Under torchrun: time gloo all-reduces on this machine. Rank 0 prints JSON: the per-hop
latency (from a 1 KiB all-reduce), the bandwidth of a 64 MiB one, and the time of each
size given with `--bytes` (a step's DDP buckets, say), reduced one after another. All in
`--dtype`: gloo sums 16-bit floats element by element through float32, so where the CPUs
rather than the link bound an all-reduce, its bytes go slower than float32's."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

SMALL, LARGE = 1024, 64 * 2**20  # bytes: 1 KiB and 64 MiB
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def timed(tensors: list[torch.Tensor], repeats: int) -> float:
    """Median seconds to all-reduce every tensor in turn, ranks starting together."""
    for tensor in tensors:
        dist.all_reduce(tensor)  # warm the connections
    samples = []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        for tensor in tensors:
            dist.all_reduce(tensor)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bytes", type=int, nargs="*", default=[], help="sizes reduced as one step")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="the tensors' type")
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]

    def tensor(size_bytes: int) -> torch.Tensor:
        return torch.ones(size_bytes // dtype.itemsize, dtype=dtype)

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    hops = 2 * (world - 1)
    latency = timed([tensor(SMALL)], 50) / hops
    large = timed([tensor(LARGE)], 5)
    bandwidth = (hops / world) * LARGE / max(large - hops * latency, 1e-9)
    step = timed([tensor(size) for size in args.bytes], 20) if args.bytes else 0.0
    if dist.get_rank() == 0:
        print(
            json.dumps(
                {"world_size": world, "latency_s": latency, "bandwidth_bytes_s": bandwidth, "step_s": step}
            )
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
