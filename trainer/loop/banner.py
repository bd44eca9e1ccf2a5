"""The lines a run starts with (who and where, the batch math, the plan, what a resume
changed) and the gauges that describe the run's shape."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from trainer.checkpoint.recovery import ResumePoint
from trainer.config import Config
from trainer.distributed.process_group import DistContext
from trainer.loop.optim import BatchMath
from trainer.telemetry.log import event, plural
from trainer.telemetry.metrics import Metrics
from trainer.telemetry.startup import STARTUP, describe


@dataclass(frozen=True)
class RunFacts:
    """What the banner tells about a run, gathered once it is planned."""

    device: str
    device_name: str
    parameters: int
    train_samples: int
    tokens_per_sample: int
    flops_per_sample: float | None
    peak_flops: float
    steps_per_epoch: int
    total_steps: int
    checkpoint_uri: str
    epoch: int  # the epoch the run starts in, from 1
    snapshot_every: int
    epoch_restarted_after: int | None  # samples of the epoch seen before its data changed

    @classmethod
    def of(cls, trainer: Any) -> RunFacts:
        """The facts of a planned `trainer.loop.engine.Trainer` (not imported: the engine
        imports this module)."""
        return cls(
            device=str(trainer.device),
            device_name=trainer.device_name,
            parameters=sum(p.numel() for p in trainer.module.parameters()),
            train_samples=len(trainer.splits.train),
            tokens_per_sample=trainer.splits.spec.tokens_per_sample,
            flops_per_sample=trainer.flops_per_sample,
            peak_flops=trainer.peak_flops,
            steps_per_epoch=trainer.steps_per_epoch,
            total_steps=trainer.total_steps,
            checkpoint_uri=trainer.checkpointer.store.uri,
            epoch=trainer.progress.epoch + 1,
            snapshot_every=trainer.checkpoints.snapshot_every,
            epoch_restarted_after=trainer.restored.epoch_restarted_after,
        )


def announce_start(
    log: logging.Logger,
    metrics: Metrics,
    config: Config,
    context: DistContext,
    math: BatchMath,
    facts: RunFacts,
    point: ResumePoint | None,
    resume_notes: list[str],
) -> None:
    """Rank 0's start lines (`rank 0 on host ...`, the batch math, what a resume changed,
    the plan with where it resumed from), and the run's gauges on every rank."""
    backend = dist.get_backend()
    fields = {
        "world_size": context.world_size,
        "nodes": context.num_nodes,
        "procs_per_node": context.local_world_size,
        "rank0_host": context.hostname,
        "restart_count": context.restart_count,
        "run_id": context.run_id,
        "device": facts.device,
        "device_name": facts.device_name,
        "backend": backend,
        "amp": config.train.amp,
        "compile": config.train.compile,
        "global_batch": math.global_batch,
        "lr": math.lr,
        "dataset": config.data.name,
        "train_samples": facts.train_samples,
        "tokens_per_sample": facts.tokens_per_sample,
        "model": config.model.name,
        "parameters": facts.parameters,
        "flops_per_sample": facts.flops_per_sample,
        "peak_flops_per_device": facts.peak_flops or None,
        "steps_per_epoch": facts.steps_per_epoch,
        "total_steps": facts.total_steps,
        "checkpoint_uri": facts.checkpoint_uri,
        "resumed_from_step": None if point is None else point.step,
    }
    nodes = plural(context.num_nodes, "node")
    procs = plural(context.local_world_size, "process", "processes")
    train = config.train
    amp = f", amp {train.amp}" * (train.amp != "off")
    precision = amp + f", compile {train.compile}" * (train.compile != "off")
    event(
        log,
        "start",
        f"rank 0 on host {context.hostname}: world size {context.world_size} ({nodes} x {procs}), "
        f"device {facts.device} ({backend}{precision}), run id {context.run_id}, "
        f"restart {context.restart_count}",
        **fields,
    )
    event(log, "batch_math", math.describe(), **math.as_fields())
    for note in resume_notes:
        event(log, "resume_change", note)
    event(
        log,
        "plan",
        f"{config.model.name} ({facts.parameters:,} params) on {config.data.name} "
        f"({facts.train_samples} train samples): "
        f"{facts.steps_per_epoch} steps/epoch, {facts.total_steps} steps; checkpoints in "
        f"{facts.checkpoint_uri}" + (f", {point.describe()}" if point is not None else ""),
        resumed_from=None if point is None else point.step,
        resume_origin=None if point is None else point.origin,
        lost_steps=None if point is None else point.lost_steps,
    )
    metrics.progress(
        {
            "global_batch": math.global_batch,
            "world_size": context.world_size,
            "restart_count": context.restart_count,
            "epoch": facts.epoch,
            "peak_flops": facts.peak_flops or None,
            "checkpoint_every_steps": config.checkpoint.every_steps,
            "snapshot_every_steps": facts.snapshot_every or None,
            "recovery_lost_steps": point and point.lost_steps,
            "epoch_restarted_after": facts.epoch_restarted_after,
        }
    )


def announce_startup(log: logging.Logger, metrics: Metrics, restart_count: int, compiled: bool) -> None:
    """After the first step: where the start-up's time went, in rank 0's line (`startup`)
    and every rank's `ddp_startup_seconds{phase}`."""
    STARTUP.mark("first step")
    parts = STARTUP.parts(restart_count)
    metrics.startup(parts)
    seconds = {phase.replace(" ", "_"): round(spent, 3) for phase, spent in parts}
    event(log, "startup", describe(parts, compiled), **seconds, total_seconds=round(sum(seconds.values()), 3))
