"""Under torchrun: the plainest DDP loop (the floor for framework overhead), on the same
data and model the trainer builds, validating after every epoch and printing rank 0's loss
every `--log-every` steps as the lesson's loop does, then its steady-state global
samples/s as JSON. On CUDA it runs as nanoGPT does: the model on the rank's GPU, bf16
autocast and `torch.compile(model)` where `train.amp` and `train.compile` ask (their `auto`
as the trainer resolves it), then DDP.

    torchrun --nproc_per_node=2 -m benchmarks.bare_ddp [--set key=value ...]
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from benchmarks.baseline import RateMeter, parse_baseline_args
from trainer.config import Config
from trainer.data import build_data
from trainer.distributed.process_group import process_group, read_env, select_device
from trainer.loop.objective import training_loss
from trainer.loop.step import autocast_for
from trainer.models import build_model
from trainer.run.device_defaults import for_device, set_math


@torch.no_grad()
def validate(model: torch.nn.Module, loader: DataLoader, device: torch.device, amp: str) -> float:
    """Mean validation loss over every rank's shard (padding included: it is a baseline)."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for inputs, targets in loader:
        inputs, targets = inputs.to(device), targets.to(device)
        with autocast_for(device, amp):
            loss = training_loss(model(inputs), targets)
        total += torch.stack([loss.double() * targets.numel(), torch.tensor(targets.numel(), device=device)])
    model.train()
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def train(config: Config, log_every: int, device: torch.device) -> str:
    """The loop itself; returns the rate report."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(config.seed)
    splits = build_data(config.data, config.seed)
    module = build_model(config.model, splits.spec).to(device)
    if config.train.compile != "off":
        module = torch.compile(module)
    model = DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)
    amp = config.train.amp
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.optim.lr)
    sampler = DistributedSampler(
        splits.train, num_replicas=world, rank=rank, seed=config.seed, drop_last=True
    )
    loader = DataLoader(splits.train, batch_size=config.train.batch_size, sampler=sampler, drop_last=True)
    val_loader = DataLoader(
        splits.val,
        batch_size=config.train.eval_batch_size,
        sampler=DistributedSampler(splits.val, num_replicas=world, rank=rank, shuffle=False),
    )
    meter = RateMeter(log_every, config.train.batch_size * world)
    for epoch in range(config.train.epochs):
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            with autocast_for(device, amp):
                loss = training_loss(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            meter.step()
            if rank == 0 and meter.steps % log_every == 0:
                print(f"epoch {epoch} step {meter.steps} loss {loss.item():.4f}", flush=True)
            if meter.steps == config.train.max_steps:
                break
        with meter.paused():
            validate(model, val_loader, device, amp)
        if meter.steps == config.train.max_steps:
            break
    return meter.report()


def main() -> None:
    config, log_every = parse_baseline_args(__doc__)
    # the trainer's own group setup and teardown: exits must not abort the measurement
    context = read_env()
    device = select_device(config.train.device, context)
    config = for_device(config, device)
    set_math(config, device)
    with process_group(context, device, timeout_s=600):
        report = train(config, log_every, device)
    if context.is_main:
        print(report)


if __name__ == "__main__":
    main()
