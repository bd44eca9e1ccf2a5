"""Under torchrun: the plainest DDP loop (the floor for framework overhead), on the same
data and model the trainer builds, printing its steady-state global samples/s as JSON.

    torchrun --nproc_per_node=2 -m operator_scripts.bare_ddp [--set key=value ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from trainer.config import load_config
from trainer.data import build_data
from trainer.models import build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default=None)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--log-every", type=int, default=20)
    args = parser.parse_args()
    config = load_config(args.config, args.overrides)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(config.seed)
    splits = build_data(config.data, config.seed)
    model = DistributedDataParallel(build_model(config.model, splits.spec))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.optim.lr)
    sampler = DistributedSampler(
        splits.train, num_replicas=world, rank=rank, seed=config.seed, drop_last=True
    )
    loader = DataLoader(splits.train, batch_size=config.train.batch_size, sampler=sampler, drop_last=True)
    rates, step, window_start = [], 0, time.perf_counter()
    for epoch in range(config.train.epochs):
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            logits = model(inputs)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step % args.log_every == 0:
                now = time.perf_counter()
                rates.append(args.log_every * config.train.batch_size * world / (now - window_start))
                window_start = now
            if config.train.max_steps and step >= config.train.max_steps:
                break
        if config.train.max_steps and step >= config.train.max_steps:
            break
    if rank == 0:
        print(json.dumps({"samples_per_second": statistics.median(rates[2:] or rates), "steps": step}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
