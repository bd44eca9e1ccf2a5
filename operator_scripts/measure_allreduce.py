"""Under torchrun: time gloo all-reduces of a small and a large tensor on this machine and
fit the ring model's per-hop latency and bandwidth; rank 0 prints them as JSON."""

from __future__ import annotations

import json
import statistics
import time

import torch
import torch.distributed as dist

SMALL, LARGE = 256, 16 * 2**20  # float32 elements: 1 KiB and 64 MiB


def timed(elements: int, repeats: int) -> float:
    tensor = torch.ones(elements)
    dist.all_reduce(tensor)  # warm the connections
    samples = []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(tensor)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def main() -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    small, large = timed(SMALL, 50), timed(LARGE, 5)
    hops = 2 * (world - 1)
    latency = small / hops
    bandwidth = (hops / world) * LARGE * 4 / max(large - hops * latency, 1e-9)
    if dist.get_rank() == 0:
        print(json.dumps({"world_size": world, "latency_s": latency, "bandwidth_bytes_s": bandwidth}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
