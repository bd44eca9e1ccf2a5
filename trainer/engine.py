"""The training loop: resume, train with periodic logs and checkpoints, validate, stop, test."""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from trainer.checkpoint import Checkpointer, CheckpointError, CheckpointWriter, rng
from trainer.config import Config, ConfigError, TrainConfig, to_tree
from trainer.data import DataSplits, eval_loader, train_loader
from trainer.distributed import DistContext, broadcast_flag, broadcast_int
from trainer.early_stopping import EarlyStopping
from trainer.evaluate import evaluate
from trainer.log import event
from trainer.metrics import Metrics, peak_flops
from trainer.optim import batch_math, build_optimizer, build_scheduler
from trainer.step import autocast_for, train_step
from trainer.straggler import BackwardClock, straggler_lag


@dataclass
class Progress:
    """Where training stands; `epoch_position` counts global samples consumed this epoch."""

    step: int = 0
    epoch: int = 0
    epoch_position: int = 0
    stopped_early: bool = False


class Window:
    """Timing since the last progress line: steps, training time and time spent waiting for
    data. It runs across epoch boundaries, so every line covers the same number of steps."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.started = time.perf_counter()
        self.excluded = 0.0
        self.steps = 0
        self.data_wait = 0.0
        self.busy = 0.0
        self.loss_sum: torch.Tensor | None = None

    @property
    def training_seconds(self) -> float:
        """Wall time since the last line, less validation and checkpoint snapshots."""
        return time.perf_counter() - self.started - self.excluded

    @contextmanager
    def excluding(self) -> Iterator[None]:
        """Time spent in the block does not count as training time."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.excluded += time.perf_counter() - started

    def add(self, loss: torch.Tensor, data_wait: float, compute: float) -> None:
        self.steps += 1
        self.data_wait += data_wait
        self.busy += data_wait + compute
        self.loss_sum = loss if self.loss_sum is None else self.loss_sum + loss


class Trainer:
    """Owns the model, optimizer, schedule, loaders and checkpoints of one run."""

    def __init__(
        self,
        config: Config,
        context: DistContext,
        device: torch.device,
        splits: DataSplits,
        module: nn.Module,
        checkpointer: Checkpointer,
        logger: logging.Logger,
        metrics: Metrics,
    ) -> None:
        self.config, self.context, self.device = config, context, device
        self.splits, self.checkpointer, self.log, self.metrics = splits, checkpointer, logger, metrics
        self.writer = CheckpointWriter(
            checkpointer,
            background=config.checkpoint.async_save,
            attempts=config.checkpoint.attempts,
            logger=logger,
        )
        self.module = module.to(device)
        self.math = batch_math(config.train, config.optim, context.world_size)
        self.optimizer = build_optimizer(self.module, config.optim, self.math.lr)
        self.scaler = torch.amp.GradScaler(device.type, enabled=config.train.amp == "fp16")
        self.autocast = autocast_for(device, config.train.amp)
        self.loader = train_loader(
            splits.train,
            config.data,
            batch_size=config.train.batch_size,
            rank=context.rank,
            world_size=context.world_size,
            seed=config.seed,
            device=device,
        )
        self.sampler = self.loader.sampler
        self.steps_per_epoch = steps_per_epoch(len(splits.train), config.train, context.world_size)
        epoch_steps = config.train.epochs * self.steps_per_epoch
        self.total_steps = min(config.train.max_steps, epoch_steps) if config.train.max_steps else epoch_steps
        self.scheduler = build_scheduler(self.optimizer, config.optim, self.total_steps)
        self.stopper = EarlyStopping(config.train.early_stopping)
        self.progress = Progress()
        self.resumed_from: int | None = None
        self.last_validated: int | None = None
        self.val_metrics: dict[str, float] = {}
        self.model: DistributedDataParallel | None = None
        self.clock = BackwardClock()
        self.grad_norm: float | None = None
        self.flops_per_sample: float | None = getattr(module, "flops_per_sample", None)
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        self.peak_flops = peak_flops(config.metrics, device_name)

    # ----- lifecycle -------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Resume if possible, train to the end, test, and return the summary. However the
        run ends (a SIGTERM included), rank 0 first lets the checkpoint in flight finish."""
        try:
            return self._run()
        finally:
            self.writer.close(self.config.checkpoint.drain_timeout_s)

    def _run(self) -> dict[str, Any]:
        self._restore()
        self.model = DistributedDataParallel(
            self.module, device_ids=[self.device.index] if self.device.type == "cuda" else None
        )
        if self.config.metrics.port:
            self.clock.install(self.module)
        self._banner()
        self.metrics.progress(
            {
                "global_batch": self.math.global_batch,
                "world_size": self.context.world_size,
                "restart_count": self.context.restart_count,
                "epoch": self.progress.epoch + 1,
                "peak_flops": self.peak_flops or None,
                "checkpoint_every_steps": self.config.checkpoint.every_steps,
            }
        )
        started = time.perf_counter()
        if self._finished():
            event(
                self.log,
                "already_complete",
                f"run already complete at step {self.progress.step}; testing only",
            )
        else:
            self._fit()
        if self.last_validated != self.progress.step:
            self._validate()
        self.writer.wait()
        self.metrics.checkpoints(self.writer.stats)
        self.metrics.flush()
        test = self._evaluate(self.splits.test) if len(self.splits.test) else {}
        summary = {
            "steps": self.progress.step,
            "epochs_completed": self.progress.epoch,
            "val_loss": self.val_metrics.get("loss"),
            "val_accuracy": self.val_metrics.get("accuracy"),
            "test_loss": test.get("loss"),
            "test_accuracy": test.get("accuracy"),
            "wall_seconds": round(time.perf_counter() - started, 3),
            "checkpoint": self._newest_checkpoint(),
        }
        event(self.log, "summary", _summary_line(summary), **summary)
        return summary

    def _newest_checkpoint(self) -> str | None:
        step = self.writer.stats.last_success_step if self.context.is_main else self.progress.step
        return None if step is None else self.checkpointer.store.location(step)

    def _banner(self) -> None:
        ctx, cfg = self.context, self.config
        params = sum(p.numel() for p in self.module.parameters())
        fields = {
            "world_size": ctx.world_size,
            "nodes": ctx.num_nodes,
            "procs_per_node": ctx.local_world_size,
            "rank0_host": ctx.hostname,
            "restart_count": ctx.restart_count,
            "run_id": ctx.run_id,
            "device": str(self.device),
            "backend": dist.get_backend(),
            "global_batch": self.math.global_batch,
            "lr": self.math.lr,
            "dataset": cfg.data.name,
            "train_samples": len(self.splits.train),
            "model": cfg.model.name,
            "parameters": params,
            "steps_per_epoch": self.steps_per_epoch,
            "total_steps": self.total_steps,
            "checkpoint_uri": self.checkpointer.store.uri,
            "resumed_from_step": self.resumed_from,
        }
        nodes = _plural(ctx.num_nodes, "node")
        procs = _plural(ctx.local_world_size, "process", "processes")
        event(
            self.log,
            "start",
            f"rank 0 on host {ctx.hostname}: world size {ctx.world_size} ({nodes} x {procs}), "
            f"device {self.device} ({fields['backend']}), run id {ctx.run_id}, restart {ctx.restart_count}",
            **fields,
        )
        event(self.log, "batch_math", self.math.describe(), **self.math.as_fields())
        event(
            self.log,
            "plan",
            f"{cfg.model.name} ({params:,} params) on {cfg.data.name} "
            f"({len(self.splits.train)} train samples): "
            f"{self.steps_per_epoch} steps/epoch, {self.total_steps} steps; checkpoints in "
            f"{self.checkpointer.store.uri}"
            + (f", resumed from step {self.resumed_from}" if self.resumed_from is not None else ""),
        )

    # ----- training ----------------------------------------------------------------------

    def _fit(self) -> None:
        bar = tqdm(
            total=self.total_steps,
            initial=self.progress.step,
            file=sys.stdout,
            disable=not (self.context.is_main and sys.stdout.isatty()),
            unit="step",
            dynamic_ncols=True,
        )
        window = Window()
        with bar, logging_redirect_tqdm(loggers=[self.log]):
            while not self._finished():
                self._train_epoch(bar, window)

    def _train_epoch(self, bar: tqdm, window: Window) -> None:
        progress, train = self.progress, self.config.train
        self.sampler.set_epoch(progress.epoch)
        self.sampler.resume_at(progress.epoch_position)
        batches = iter(self.loader)
        samples_per_step = self.math.global_batch
        samples_per_rank = train.batch_size * train.grad_accum_steps
        tokens_per_rank = samples_per_rank * self.splits.spec.tokens_per_sample
        while True:
            started = time.perf_counter()
            micro_batches = [next(batches) for _ in range(train.grad_accum_steps)]
            fetched = time.perf_counter()
            result = train_step(
                self.model,
                micro_batches,
                self.optimizer,
                self.scaler,
                amp=train.amp,
                clip_grad_norm=train.clip_grad_norm,
            )
            self.scheduler.step()
            ended = time.perf_counter()
            waited = fetched - started
            compute = self.clock.compute_since(fetched) or ended - fetched
            self.metrics.step(
                samples=samples_per_rank,
                tokens=tokens_per_rank,
                seconds=ended - started,
                data_wait=waited,
                compute=compute,
            )
            if result.grad_norm is not None:
                self.grad_norm = result.grad_norm
            progress.step += 1
            progress.epoch_position += samples_per_step
            window.add(result.loss, waited, compute)
            bar.update(1)
            if progress.step % self.config.log.every_steps == 0 or progress.step == self.total_steps:
                self._log_progress(window)
            epoch_done = progress.epoch_position + samples_per_step > self.sampler.total_size
            if epoch_done:
                with window.excluding():
                    self._end_epoch()
            finished = self._finished()
            every = self.config.checkpoint.every_steps
            if finished or (every and progress.step % every == 0):
                with window.excluding():
                    self._save()
            if epoch_done or finished:
                return

    def _finished(self) -> bool:
        """Done by steps, by epochs or by early stopping; derived, so a resumed run with a
        larger `train.max_steps` or `train.epochs` carries on."""
        progress = self.progress
        return (
            progress.stopped_early
            or progress.step >= self.total_steps
            or progress.epoch >= self.config.train.epochs
        )

    def _log_progress(self, window: Window) -> None:
        """One gather of every rank's loss, busy and data-wait time; rank 0 logs and exports."""
        local = torch.tensor(
            [window.loss_sum.item(), window.busy, window.data_wait], dtype=torch.float64, device=self.device
        )
        gathered = [torch.zeros_like(local) for _ in range(self.context.world_size)]
        dist.all_gather(gathered, local)
        table = torch.stack(gathered).cpu()
        if not self.context.is_main:
            self.metrics.progress({"epoch": self.progress.epoch + 1})
            window.reset()
            return
        elapsed = window.training_seconds
        progress = self.progress
        mean_loss = table[:, 0].sum().item() / self.context.world_size / window.steps
        rate = window.steps * self.math.global_batch / elapsed
        lag, slowest = straggler_lag(table[:, 1].tolist())
        eta = (self.total_steps - progress.step) * elapsed / window.steps
        fields = {
            "epoch": progress.epoch + 1,
            "epochs": self.config.train.epochs,
            "step": progress.step,
            "total_steps": self.total_steps,
            "loss": round(mean_loss, 6),
            "lr": self.scheduler.get_last_lr()[0],
            "samples_per_second": round(rate, 1),
            "data_wait_share": round(window.data_wait / elapsed, 4),
            "eta_seconds": round(eta, 1),
        }
        event(
            self.log,
            "progress",
            f"epoch {fields['epoch']}/{fields['epochs']} step {progress.step}/{self.total_steps} "
            f"loss {mean_loss:.4f} lr {fields['lr']:.3e} {rate:,.0f} samples/s "
            f"data wait {100 * fields['data_wait_share']:.1f}% eta {_duration(eta)}",
            **fields,
        )
        mfu = None
        if self.flops_per_sample and self.peak_flops:
            mfu = self.flops_per_sample * rate / (self.peak_flops * self.context.world_size)
        self.metrics.checkpoints(self.writer.stats)
        self.metrics.progress(
            {
                "loss": mean_loss,
                "lr": fields["lr"],
                "grad_norm": None if self.grad_norm is None else float(self.grad_norm),
                "epoch": fields["epoch"],
                "samples_per_second": rate,
                "mfu": mfu,
                "straggler_lag": lag,
                "slowest_rank": slowest,
            }
        )
        self._append_history({**fields, "mfu": mfu, "straggler_lag": lag, "time": time.time()})
        window.reset()

    def _append_history(self, record: dict[str, Any]) -> None:
        """Rank 0's progress as JSON lines, the run report's input (`metrics.history_file`)."""
        if self.config.metrics.history_file:
            with open(self.config.metrics.history_file, "a") as handle:
                handle.write(json.dumps(record) + "\n")

    def _end_epoch(self) -> None:
        """Validate, let early stopping decide (rank 0's decision for all), move to the next epoch."""
        metrics = self._validate()
        stop = broadcast_flag(self.stopper.update(metrics), self.device)
        self.progress.epoch += 1
        self.progress.epoch_position = 0
        if stop:
            event(
                self.log,
                "early_stop",
                f"early stopping after epoch {self.progress.epoch}: no {self.stopper.config.metric} "
                f"improvement for {self.stopper.bad_epochs} epochs (best {self.stopper.best:.4f})",
                epoch=self.progress.epoch,
                best=self.stopper.best,
            )
        self.progress.stopped_early = stop

    def _validate(self) -> dict[str, float]:
        metrics = self._evaluate(self.splits.val)
        self.val_metrics, self.last_validated = metrics, self.progress.step
        self.metrics.validation(metrics["loss"], metrics["accuracy"])
        event(
            self.log,
            "validation",
            f"validation after step {self.progress.step}: loss {metrics['loss']:.4f} "
            f"accuracy {100 * metrics['accuracy']:.2f}% ({int(metrics['samples'])} samples)",
            step=self.progress.step,
            val_loss=metrics["loss"],
            val_accuracy=metrics["accuracy"],
            val_samples=int(metrics["samples"]),
        )
        return metrics

    def _evaluate(self, dataset: torch.utils.data.Dataset) -> dict[str, float]:
        loader = eval_loader(
            dataset,
            self.config.data,
            batch_size=self.config.train.eval_batch_size,
            rank=self.context.rank,
            world_size=self.context.world_size,
            device=self.device,
        )
        return evaluate(self.module, loader, self.device, self.autocast)

    # ----- checkpoints -------------------------------------------------------------------

    def _save(self) -> None:
        """Every rank contributes its RNG state; rank 0 alone snapshots and writes."""
        rng_states = [None] * self.context.world_size if self.context.is_main else None
        dist.gather_object(rng.capture(), rng_states, dst=0)
        if not self.context.is_main:
            return
        state = {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "progress": asdict(self.progress),
            "early_stopping": self.stopper.state_dict(),
            "rng": rng_states,
            "config": to_tree(self.config),
            "world_size": self.context.world_size,
        }
        self.writer.save(
            state, step=self.progress.step, epoch=self.progress.epoch, world_size=self.context.world_size
        )

    def _restore(self) -> None:
        """Rank 0 picks the newest intact step; every rank loads it (model, optimizer,
        schedule, scaler, progress and its own RNG stream)."""
        found = self.checkpointer.find_resumable() if self.context.is_main else None
        step = broadcast_int(-1 if found is None else found, self.device)
        if step < 0:
            return
        if self.context.is_node_main and not self.context.is_main:
            self.checkpointer.fetch_verified(step)  # one download per node
        dist.barrier()
        state = self.checkpointer.load(step)
        dist.barrier()
        if self.context.is_node_main:
            self.checkpointer.release(step)
        try:
            self.module.load_state_dict(state["model"])
        except RuntimeError as error:
            detail = str(error).splitlines()[1].strip() if "\n" in str(error) else str(error)
            raise CheckpointError(
                "checkpoint.uri",
                self.checkpointer.store.uri,
                f"step {step} holds a different model than model.name={self.config.model.name} ({detail})",
            ) from None
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.stopper.load_state_dict(state["early_stopping"])
        self.progress = Progress(**state["progress"])
        if state["world_size"] == self.context.world_size:
            rng.restore(state["rng"][self.context.rank])
        else:
            rng.seed_everything(self.config.seed + 1_000_003 * (step + 1) + self.context.rank)
        self.resumed_from = self.writer.stats.last_success_step = step
        self.checkpointer.protected.add(step)


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


def _plural(count: int, singular: str, plural: str | None = None) -> str:
    return f"{count} {singular if count == 1 else plural or singular + 's'}"


def _duration(seconds: float) -> str:
    """`4.2s` under a minute, else `m:ss` or `h:mm:ss`."""
    if not math.isfinite(seconds):
        return "?"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _summary_line(summary: dict[str, Any]) -> str:
    def pct(value: float | None) -> str:
        return "n/a" if value is None else f"{100 * value:.2f}%"

    def num(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.4f}"

    return (
        f"done: {summary['steps']} steps, {summary['epochs_completed']} epochs in "
        f"{_duration(summary['wall_seconds'])}; val loss {num(summary['val_loss'])} "
        f"accuracy {pct(summary['val_accuracy'])}; test loss {num(summary['test_loss'])} "
        f"accuracy {pct(summary['test_accuracy'])}; checkpoint {summary['checkpoint']}"
    )
