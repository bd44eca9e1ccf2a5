"""Exact distributed evaluation: DistributedSampler's padding is masked out, sums all-reduced."""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from trainer.config import Config
from trainer.data import DataSplits, eval_loader
from trainer.distributed import heartbeat as phases
from trainer.distributed.heartbeat import Heartbeat
from trainer.distributed.process_group import DistContext
from trainer.loop.objective import per_sample_terms
from trainer.loop.step import autocast_for
from trainer.telemetry.log import event
from trainer.telemetry.metrics import Metrics
from trainer.telemetry.progress import append_history


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: DataLoader,
    device: torch.device,
    autocast: AbstractContextManager,
) -> dict[str, float]:
    """Loss and accuracy over every sample exactly once, identical on every rank.

    Sample j of rank r is DistributedSampler padding iff j * world + r >= len(dataset)."""
    sampler = loader.sampler
    assert isinstance(sampler, DistributedSampler)
    world, rank, size = sampler.num_replicas, sampler.rank, len(loader.dataset)
    totals = torch.zeros(4, dtype=torch.float64, device=device)
    seen = 0
    was_training = model.training
    model.eval()
    for inputs, targets in loader:
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with autocast:
            logits = model(inputs)
        losses, correct, counts = per_sample_terms(logits, targets)
        positions = torch.arange(seen, seen + len(targets), device=device)
        real = (positions * world + rank < size).to(torch.float64)
        seen += len(targets)
        totals += torch.stack(
            [(losses * real).sum(), (correct * real).sum(), (counts * real).sum(), real.sum()]
        )
    model.train(was_training)
    dist.all_reduce(totals)
    loss_sum, correct, elements, samples = totals.tolist()
    return {"loss": loss_sum / elements, "accuracy": correct / elements, "samples": samples}


def log_validation(log: logging.Logger, step: int, metrics: dict[str, float]) -> None:
    """Rank 0's `validation after step N: loss ... accuracy ...` line."""
    event(
        log,
        "validation",
        f"validation after step {step}: loss {metrics['loss']:.4f} "
        f"accuracy {100 * metrics['accuracy']:.2f}% ({int(metrics['samples'])} samples)",
        step=step,
        val_loss=metrics["loss"],
        val_accuracy=metrics["accuracy"],
        val_samples=int(metrics["samples"]),
    )


class Evaluator:
    """Validation and test of one run on every rank, each under its heartbeat phase; the
    newest validation's metrics and step stay for the run's summary."""

    def __init__(
        self,
        module: nn.Module,
        splits: DataSplits,
        config: Config,
        context: DistContext,
        device: torch.device,
        heartbeat: Heartbeat,
        metrics: Metrics,
        log: logging.Logger,
    ) -> None:
        self.module, self.splits, self.config, self.context, self.device = (
            module,
            splits,
            config,
            context,
            device,
        )
        self.heartbeat, self.metrics, self.log = heartbeat, metrics, log
        self.autocast = autocast_for(device, config.train.amp)
        self.val_metrics: dict[str, float] = {}
        self.last_validated: int | None = None
        self.val_loader: DataLoader | None = None  # built once: its workers stay

    def _loader(self, dataset: torch.utils.data.Dataset, *, persistent: bool) -> DataLoader:
        return eval_loader(
            dataset,
            self.config.data,
            batch_size=self.config.train.eval_batch_size,
            rank=self.context.rank,
            world_size=self.context.world_size,
            device=self.device,
            persistent=persistent,
        )

    def validate(self, step: int) -> dict[str, float]:
        with self.heartbeat.phase(phases.VALIDATION):
            if self.val_loader is None:
                self.val_loader = self._loader(self.splits.val, persistent=True)
            metrics = evaluate(self.module, self.val_loader, self.device, self.autocast)
        self.val_metrics, self.last_validated = metrics, step
        self.metrics.validation(metrics["loss"], metrics["accuracy"])
        log_validation(self.log, step, metrics)
        if self.context.is_main:
            record = {"event": "validation", "step": step, "val_loss": metrics["loss"]}
            append_history(self.config.metrics.history_file, {**record, "val_accuracy": metrics["accuracy"]})
        return metrics

    def test(self) -> dict[str, float]:
        with self.heartbeat.phase(phases.TEST):
            if not len(self.splits.test):
                return {}
            loader = self._loader(self.splits.test, persistent=False)
            return evaluate(self.module, loader, self.device, self.autocast)
