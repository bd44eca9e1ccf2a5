"""One batch through the model, loss and backward before any process group.

A model and data that do not fit together (a missing Flatten, a wrong number of classes, a
sample that is not an (inputs, targets) pair) would otherwise fail on every rank's first
step, as a traceback per rank that torchrun retries as if it were a crash. Here it is one
line naming the plug-ins, the batch's shapes and the error, and exit 2 (permanent).

The batch runs on a copy of the model on the meta device: shapes and dtypes are checked,
nothing is computed or allocated, and the model's own state and the RNG are not touched.
Its FLOPs are counted on the way, for the MFU of a model that declares none.
Only where the meta device cannot run the model (an op without a meta kernel, `.item()`)
the same batch runs for real, on a copy on the training device, and that decides."""

from __future__ import annotations

import copy
import itertools
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils.data import default_collate
from torch.utils.flop_counter import FlopCounterMode

from trainer.config import Config, ConfigError
from trainer.config.registry import DATASETS
from trainer.data.base import DataSplits
from trainer.loop.objective import training_loss
from trainer.loop.step import autocast_for

META = torch.device("meta")


class ProbeFailed(Exception):
    """Where in the step the batch failed (forward, loss or backward), and why."""

    def __init__(self, stage: str, error: Exception) -> None:
        super().__init__(f"{stage}: {type(error).__name__}: {first_line(error)}".rstrip(": "))


def probe_plugins(config: Config, splits: DataSplits, module: nn.Module, device: torch.device) -> None:
    """Raise ConfigError naming model and data when one training batch cannot go through.
    The RNG is as before (a dropout on the real run would draw from it)."""
    inputs, targets = first_batch(config, splits)
    cuda = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):
        try:
            meta = meta_copy(module)
        except (TypeError, RuntimeError, NotImplementedError):  # it holds a lock, a handle
            return  # then it cannot be copied to run for real either
        try:
            with FlopCounterMode(display=False) as counter:
                step(meta, inputs.to(META), targets.to(META), nullcontext())
            declare_flops(module, counter.get_total_flops() / len(inputs))
            return
        except ProbeFailed:
            pass  # a real error, or an op the meta device lacks: the real run tells them apart
        try:
            model = copy.deepcopy(module).to(device).train()
            step(model, inputs.to(device), targets.to(device), autocast_for(device, config.train.amp))
        except ProbeFailed as failed:
            shapes = f"inputs {describe(inputs)}, targets {describe(targets)}"
            raise ConfigError(
                "model.name",
                config.model.name,
                f"one batch of data.name={config.data.name!r} ({shapes}) fails in the {failed}",
            ) from None


def declare_flops(module: nn.Module, counted: float) -> None:
    """A model that does not declare its training FLOPs per sample (`flops_per_sample`, as
    the bundled transformer does) gets what the meta pass counted: forward and backward's
    matmuls, convolutions and attention (torch's FlopCounterMode), so that MFU is known for
    any model. Counted per sample of the probe's batch."""
    if getattr(module, "flops_per_sample", None) is None and counted > 0:
        module.flops_per_sample = counted


def first_batch(config: Config, splits: DataSplits) -> tuple[torch.Tensor, torch.Tensor]:
    """A training batch as the loader collates it, from the first validation sample:
    reading that has no side effect that validation would not have, where the training
    split may record its reads or plan what to fetch."""
    with DATASETS.calling(config.data.name):
        sample = splits.val[0]  # a plug-in dataset's own code: one line, as its builder's
    try:
        inputs, targets = default_collate([sample])
    except (TypeError, ValueError, RuntimeError) as error:
        raise ConfigError(
            "data.name",
            config.data.name,
            f"a sample must be a pair (inputs, targets) of tensors, arrays or numbers, "
            f"not {type(sample).__name__} ({first_line(error)})",
        ) from None
    if not (isinstance(inputs, torch.Tensor) and isinstance(targets, torch.Tensor)):
        raise ConfigError(
            "data.name",
            config.data.name,
            "a sample's inputs and targets must each be a tensor, array or number",
        )
    batch = config.train.batch_size
    return (
        inputs.expand(batch, *inputs.shape[1:]).contiguous(),
        targets.expand(batch, *targets.shape[1:]).contiguous(),
    )


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0]


def describe(tensor: torch.Tensor) -> str:
    return f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of `module` in training mode whose parameters and buffers are meta tensors,
    put in deepcopy's memo, so that no weight is copied."""
    memo: dict[int, Any] = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        meta = tensor.detach().to(META)
        memo[id(tensor)] = (
            nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
        )
    return copy.deepcopy(module, memo).train()


def step(
    model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, autocast: AbstractContextManager
) -> None:
    """Forward, loss and backward as the training step runs them (`trainer.loop.step`)."""
    with autocast:
        try:
            outputs = model(inputs)
        except Exception as error:
            raise ProbeFailed("forward", error) from error
        try:
            loss = training_loss(outputs, targets)
        except Exception as error:
            raise ProbeFailed("loss", error) from error
    try:
        loss.backward()
    except Exception as error:
        raise ProbeFailed("backward", error) from error
