"""What a checkpoint of a run holds, written and read in one place so that the two agree:
the weights (no `module.` prefix), optimizer, scaler, early stopping, progress, every
rank's RNG streams, PowerSGD's state where it runs, the config, the world size it was
saved at and the identity of the data it was trained on."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from trainer.checkpoint import rng
from trainer.checkpoint.manager import CheckpointError
from trainer.checkpoint.resume import config_changes, data_changes, decided_by_rank0
from trainer.config import Config, OptimConfig, from_tree, to_tree
from trainer.data.identity import DataIdentity
from trainer.distributed.process_group import DistContext
from trainer.loop.ddp import PowerSGDCheckpoint
from trainer.loop.early_stopping import EarlyStopping
from trainer.loop.optim import apply_hyperparameters, batch_math
from trainer.loop.plan import Progress, complete


@dataclass(frozen=True)
class Restored:
    """Where the loaded state puts the run, and what changed since it was saved."""

    progress: Progress
    notes: list[str] = field(default_factory=list)
    epoch_restarted_after: int | None = None  # samples of the epoch seen before its data changed
    complete: bool = False  # the run that saved it ended there, as would this one


@dataclass(frozen=True)
class TrainingState:
    """The parts of a run that a checkpoint saves and a resume loads back."""

    module: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    stopper: EarlyStopping
    data: DataIdentity
    powersgd: PowerSGDCheckpoint | None = None

    @classmethod
    def of(
        cls,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: Config,
        device: torch.device,
        data: DataIdentity,
    ) -> TrainingState:
        """The state of a run about to start: a scaler if fp16 runs, early stopping and
        PowerSGD as configured."""
        scaler = torch.amp.GradScaler(device.type, enabled=config.train.amp == "fp16")
        stopper = EarlyStopping(config.train.early_stopping)
        return cls(module, optimizer, scaler, stopper, data, PowerSGDCheckpoint.of(config.ddp, config.seed))

    def size_bytes(self, optim: OptimConfig, world_size: int) -> int:
        """The size of a saved state (`state_size_bytes`)."""
        return state_size_bytes(self.module, optim, world_size, powersgd=self.powersgd is not None)

    def tree(
        self,
        progress: Progress,
        rng_states: torch.Tensor,
        config: Config,
        world_size: int,
        errors: torch.Tensor | None = None,
    ) -> dict[str, Any]:
        """The saved tree; `rng_states` holds every rank's streams, `[world_size, bytes]`, and
        `errors` every rank's PowerSGD error feedback (`PowerSGDCheckpoint.local_errors`)."""
        extra = {} if self.powersgd is None else {"powersgd": self.powersgd.tree(errors)}
        return {
            **extra,
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "progress": asdict(progress),
            "early_stopping": self.stopper.state_dict(),
            "rng": rng_states,
            "config": to_tree(config),
            "world_size": world_size,
            "data": self.data.as_tree(),
        }

    def load(
        self, state: dict[str, Any], config: Config, context: DistContext, step: int, uri: str
    ) -> Restored:
        """Load the tree saved at `step` into every part and this rank's RNG streams. The LR
        is not restored but derived from the progress (see `trainer.loop.plan`); changed
        settings are applied and reported, or refused (CheckpointError), as other data is
        (`data.on_change`: refused, or the interrupted epoch started again)."""
        changes = config_changes(state["config"], config, step, uri)
        epoch = state["progress"]["epoch"] + 1
        saved_data = state.get("data")
        data_changed = decided_by_rank0(
            context,
            lambda: data_changes(
                saved_data, self.data, config.data, step, epoch, uri, state["progress"]["epoch_position"] > 0
            ),
        )
        try:
            self.module.load_state_dict(state["model"])
        except RuntimeError as error:
            detail = str(error).splitlines()[1].strip() if "\n" in str(error) else str(error)
            raise CheckpointError(
                "checkpoint.uri",
                uri,
                f"step {step} holds a different model than model.name={config.model.name} ({detail})",
            ) from None
        self.optimizer.load_state_dict(state["optimizer"])
        apply_hyperparameters(self.optimizer, config.optim)
        self.scaler.load_state_dict(state["scaler"])
        self.stopper.load_state_dict(state["early_stopping"])
        saved_config = from_tree(state["config"])
        saved = batch_math(saved_config.train, saved_config.optim, state["world_size"])
        progress = Progress(
            **{"samples": state["progress"]["step"] * saved.global_batch, **state["progress"]}
        )
        same_world = state["world_size"] == context.world_size
        if same_world:
            rng.restore(state["rng"][context.rank])
        else:
            rng.seed_everything(config.seed + 1_000_003 * (step + 1) + context.rank)
        notes = [f"changed since step {step}, applied: {change}" for change in changes]
        if saved_data is None:
            notes.append(f"step {step} does not record its data (an older checkpoint): it is not compared")
        restarted_after = None
        if data_changed:
            restarted_after, progress.epoch_position = progress.epoch_position, 0
            notes.append(
                f"the data changed since step {step} ({'; '.join(data_changed)}): epoch {epoch} "
                f"starts again from its beginning on this data (data.on_change=restart_epoch); "
                f"{restarted_after} of its samples had been trained on"
            )
        if self.powersgd is not None and "powersgd" in state:
            device = next(self.module.parameters()).device
            self.powersgd.load(state["powersgd"], context.rank if same_world else None, device)
            if not same_world:
                notes.append(
                    f"PowerSGD's error feedback starts at zero: step {step} has it for another world size"
                )
        now = batch_math(config.train, config.optim, context.world_size)
        if saved.global_batch != now.global_batch:
            notes.append(
                f"step {step} was saved at world size {saved.world_size}, global batch "
                f"{saved.global_batch}, lr {saved.lr:.6g}; this run trains at world size "
                f"{context.world_size}, global batch {now.global_batch}, lr {now.lr:.6g}; the rest of "
                "the run is counted in steps of this global batch, so its total steps change"
            )
        ended = all(complete(progress, train) for train in (saved_config.train, config.train))
        return Restored(progress, notes, restarted_after, ended)


def state_size_bytes(module: nn.Module, optim: OptimConfig, world_size: int, *, powersgd: bool) -> int:
    """The size of a saved state: weights and buffers, and the optimizer's per-parameter
    state (AdamW's two moments, SGD's momentum), which exists only after a first step;
    with PowerSGD, every rank's error feedback, a gradient's size each. A meta-device
    module gives the same figure (`ddp-ops render` sizes /dev/shm from it)."""
    weights = sum(t.numel() * t.element_size() for t in module.state_dict().values())
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    slots = 2 if optim.name == "adamw" else int(optim.momentum > 0)
    errors = world_size * params if powersgd else 0
    return weights + slots * params + errors + 2**20
