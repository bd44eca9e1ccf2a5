"""Under torchrun: the same model, data and optimizer trained by PyTorch Lightning's DDP
strategy (the optional `bench` extra), validating after every epoch, printing its
steady-state global samples/s as JSON.

    torchrun --nproc_per_node=2 -m benchmarks.lightning_ddp [--set key=value ...]

Lightning's extras are switched off (logger, checkpoints, progress bar, summary, sanity
check) so that it is timed doing what the other two loops do.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from benchmarks.baseline import RateMeter, parse_baseline_args
from trainer.data import build_data
from trainer.distributed.process_group import read_env
from trainer.loop.objective import training_loss
from trainer.models import build_model


class Classifier(pl.LightningModule):
    def __init__(self, model: torch.nn.Module, lr: float) -> None:
        super().__init__()
        self.model, self.lr = model, lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return training_loss(self.model(inputs), targets)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return training_loss(self.model(inputs), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class Throughput(pl.Callback):
    """Feeds the shared meter: one tick per optimizer step, validation paused out."""

    def __init__(self, meter: RateMeter) -> None:
        self.meter = meter

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.meter.step()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.meter.pause()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.meter.resume()


def main() -> None:
    config, log_every = parse_baseline_args(__doc__)
    context = read_env()
    torch.manual_seed(config.seed)
    splits = build_data(config.data, config.seed)
    module = Classifier(build_model(config.model, splits.spec), config.optim.lr)
    meter = RateMeter(log_every, config.train.batch_size * context.world_size)
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=context.local_world_size,
        num_nodes=context.num_nodes,
        max_epochs=config.train.epochs,
        max_steps=config.train.max_steps or -1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[Throughput(meter)],
    )
    trainer.fit(
        module,
        DataLoader(splits.train, batch_size=config.train.batch_size, shuffle=True, drop_last=True),
        DataLoader(splits.val, batch_size=config.train.eval_batch_size),
    )
    if trainer.global_rank == 0:
        print(meter.report())


if __name__ == "__main__":
    main()
