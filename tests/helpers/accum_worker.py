"""Under torchrun: one step accumulated over 4 micro-batches vs one step on the 4x batch,
and three accumulated steps with DDP's gradients as views of its buckets vs copies.

Counts DDP's gradient all-reduces through a comm hook, and writes the largest parameter
difference between the two models, and whether the bucket views trained bit for bit as
the copies; rank 0 writes JSON."""

import copy
import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from trainer.config import DdpConfig
from trainer.distributed.process_group import process_group, read_env
from trainer.loop.ddp import wrap
from trainer.loop.step import train_step
from trainer.telemetry.timing import HostClock

MICRO_STEPS, MICRO_BATCH = 4, 8


def counted(model: nn.Module) -> tuple[DistributedDataParallel, list[int]]:
    calls = [0]

    def hook(state, bucket):
        calls[0] += 1
        return allreduce_hook(state, bucket)

    wrapped = DistributedDataParallel(model)
    wrapped.register_comm_hook(None, hook)
    return wrapped, calls


def step(model: DistributedDataParallel, batches, steps: int = 1) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for _ in range(steps):
        train_step(model, batches, optimizer, scaler, amp="off", clip_grad_norm=1.0, clock=HostClock())


def bucket_views_are_exact(base: nn.Module, micro: list) -> bool:
    """The trainer's own wrap, gradients as bucket views or not, over steps that zero the
    gradients (to None) between them: the same bits."""
    trained = []
    for views in (False, True):
        model = wrap(copy.deepcopy(base), torch.device("cpu"), DdpConfig(gradient_as_bucket_view=views))
        step(model, micro, steps=3)
        trained.append([parameter.detach().clone() for parameter in model.parameters()])
    return all(torch.equal(a, b) for a, b in zip(*trained, strict=True))


def compare() -> dict[str, float]:
    """Both steps from the same start; DDP objects stay inside, so teardown finds them freed."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    inputs = torch.randn(MICRO_STEPS * MICRO_BATCH, 6, generator=generator)
    targets = torch.randint(0, 3, (MICRO_STEPS * MICRO_BATCH,), generator=generator)

    accumulated, accumulated_calls = counted(copy.deepcopy(base))
    micro = list(zip(inputs.split(MICRO_BATCH), targets.split(MICRO_BATCH), strict=True))
    step(accumulated, micro)

    big, big_calls = counted(copy.deepcopy(base))
    step(big, [(inputs, targets)])

    difference = max(
        (a - b).abs().max().item() for a, b in zip(accumulated.parameters(), big.parameters(), strict=True)
    )
    moved = max((a - b).abs().max().item() for a, b in zip(big.parameters(), base.parameters(), strict=True))
    return {
        "accumulated_allreduce_calls": accumulated_calls[0],
        "big_batch_allreduce_calls": big_calls[0],
        "max_difference": difference,
        "max_update": moved,
        "bucket_views_exact": bucket_views_are_exact(base, micro),
    }


def main() -> None:
    context = read_env()
    # the trainer's teardown: no abort at exit
    with process_group(context, torch.device("cpu"), timeout_s=600):
        result = compare()
    if context.is_main:
        with open(sys.argv[1], "w") as handle:
            json.dump(result, handle)


if __name__ == "__main__":
    main()
