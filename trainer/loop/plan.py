"""Where a run stands and where it will end: its progress, the steps an epoch holds at this
world size, the step the run ends at and the LR schedule over the samples up to it."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config import ConfigError, OptimConfig, TrainConfig
from trainer.loop.optim import BatchMath, LRSchedule


@dataclass
class Progress:
    """Where training stands. `samples` counts global samples trained on, `epoch_position`
    those consumed this epoch: the schedule and the epoch's remainder derive from them, so
    they hold at any world size; `step` counts optimizer steps, whatever their size."""

    step: int = 0
    epoch: int = 0
    epoch_position: int = 0
    stopped_early: bool = False
    samples: int = 0


@dataclass(frozen=True)
class Plan:
    """The step the run ends at and the LR schedule that reaches its end there."""

    total_steps: int
    schedule: LRSchedule


def steps_per_epoch(train_samples: int, train: TrainConfig, world_size: int) -> int:
    """Optimizer steps in one epoch: each rank gets floor(N / world) samples, in full
    batches, grouped by the accumulation count. Zero steps is a config error."""
    steps = train_samples // world_size // train.batch_size // train.grad_accum_steps
    if steps == 0:
        global_batch = train.batch_size * world_size * train.grad_accum_steps
        raise ConfigError(
            "train.batch_size",
            train.batch_size,
            f"too large: {train_samples} training samples cannot fill one global batch of "
            f"{global_batch} ({world_size} ranks x {train.grad_accum_steps} accumulation)",
        )
    return steps


def plan(
    progress: Progress,
    train: TrainConfig,
    optim: OptimConfig,
    math: BatchMath,
    *,
    steps_left_in_epoch: int,
    steps_per_epoch: int,
) -> Plan:
    """The run's end from where it stands at this world size: what is left of this epoch
    (`steps_left_in_epoch`, from the sampler), the epochs after it, `train.max_steps`."""
    left = 0
    if not progress.stopped_early and progress.epoch < train.epochs:
        left = steps_left_in_epoch + (train.epochs - progress.epoch - 1) * steps_per_epoch
    end = progress.step + left
    if train.max_steps:
        end = min(end, max(train.max_steps, progress.step))
    total_samples = progress.samples + (end - progress.step) * math.global_batch
    return Plan(end, LRSchedule(math.lr, math.global_batch, total_samples, optim))


def finished(progress: Progress, total_steps: int, epochs: int) -> bool:
    """Done by steps, by epochs or by early stopping; derived, so a resumed run with a
    larger `train.max_steps` or `train.epochs` carries on."""
    return progress.stopped_early or progress.step >= total_steps or progress.epoch >= epochs


def complete(progress: Progress, train: TrainConfig) -> bool:
    """Whether a run of `train`'s length would have ended at `progress`, whatever its world
    size: early stopped, its epochs done, or its `max_steps` reached."""
    reached = bool(train.max_steps) and progress.step >= train.max_steps
    return progress.stopped_early or progress.epoch >= train.epochs or reached
