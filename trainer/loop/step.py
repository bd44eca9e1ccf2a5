"""One optimizer step over k micro-batches: the part of the loop that must be exactly right."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainer.loop.objective import training_loss
from trainer.telemetry.timing import COMMUNICATION, COMPUTE, StepClock

Batch = tuple[torch.Tensor, torch.Tensor]


def autocast_for(device: torch.device, amp: str) -> AbstractContextManager:
    """bf16 or fp16 autocast on the run's device, or nothing for `amp=off`."""
    if amp == "off":
        return nullcontext()
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


@dataclass(frozen=True)
class StepResult:
    """This rank's mean loss over the step's micro-batches and the pre-clip gradient norm,
    both still on the device."""

    loss: torch.Tensor
    grad_norm: torch.Tensor | None


def train_step(
    model: DistributedDataParallel,
    micro_batches: list[Batch],
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    *,
    amp: str,
    clip_grad_norm: float,
    clock: StepClock,
) -> StepResult:
    """Accumulate gradients over the micro-batches and take one optimizer step.

    All but the last micro-batch run forward and backward inside `no_sync()`, so gradients
    are all-reduced once per step; each loss is divided by k so the sum equals the mean of a
    k-times-larger batch. The clock's `communication` lap falls when the last backward returns
    with the gradients all-reduced, its `compute` lap when the optimizer step is queued."""
    device = next(model.parameters()).device
    count = len(micro_batches)
    total: torch.Tensor | None = None
    for index, (inputs, targets) in enumerate(micro_batches):
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        sync = index == count - 1
        with nullcontext() if sync else model.no_sync():
            with autocast_for(device, amp):
                loss = training_loss(model(inputs), targets)
                if count > 1:
                    loss = loss / count
            scaler.scale(loss).backward()
        total = loss.detach() if total is None else total + loss.detach()
    clock.lap(COMMUNICATION)
    grad_norm = None
    if clip_grad_norm > 0:
        scaler.unscale_(optimizer)
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    clock.lap(COMPUTE)
    return StepResult(total, grad_norm)
