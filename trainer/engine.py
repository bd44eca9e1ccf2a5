"""The training loop: resume, train with periodic logs and checkpoints, validate, stop, test."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from trainer.checkpoint import Checkpointer, CheckpointError, CheckpointWriter, rng
from trainer.checkpoint.snapshots import AUTO_FIRST, SnapshotDir, SnapshotPacer
from trainer.config import Config, ConfigError, TrainConfig, from_tree, to_tree
from trainer.data import DataSplits, eval_loader, train_loader
from trainer.distributed import DistContext, broadcast_flag, broadcast_object
from trainer.early_stopping import EarlyStopping
from trainer.evaluate import evaluate
from trainer.log import event, plural
from trainer.metrics import Metrics, peak_flops
from trainer.optim import LRSchedule, apply_hyperparameters, batch_math, build_optimizer
from trainer.preemption import Stopped, StopSignal
from trainer.progress import ProgressLog, RunShape, Window, summary_line
from trainer.recovery import ResumePoint, recover
from trainer.resume import config_changes
from trainer.step import autocast_for, train_step
from trainer.timing import (
    CHECKPOINT,
    DATA,
    LOGGING,
    clock_for,
    lap_when_backward_ends,
    lapped,
)


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
        stop: StopSignal,
        lineage: str | None = None,
        writer_process: subprocess.Popen | None = None,
    ) -> None:
        """`lineage` is the store's history id, known to rank 0 (see `Checkpointer.lineage`);
        `writer_process` the writer spawned early for this rank, if it writes anything."""
        self.config, self.context, self.device = config, context, device
        self.splits, self.checkpointer, self.log, self.metrics = splits, checkpointer, logger, metrics
        self.stop = stop
        # what rank 0 or one node may spend alone while its peers wait in a collective
        self.solo_budget_s = config.dist.timeout_s / 2
        self.last_saved_step: int | None = None
        self.lineage = lineage
        every = config.checkpoint.snapshot_every_steps
        self.pacer = SnapshotPacer() if every == "auto" else None
        self.snapshot_every = AUTO_FIRST if every == "auto" else every
        self.snapshots: SnapshotDir | None = None
        self.writer = CheckpointWriter(
            checkpointer if context.is_main else None,
            config.checkpoint,
            logger,
            cache=checkpointer.cache,
            snapshots=context.is_node_main and self.snapshot_every > 0,
            process=writer_process,
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
        self.samples_per_rank = config.train.batch_size * config.train.grad_accum_steps
        self.tokens_per_rank = self.samples_per_rank * splits.spec.tokens_per_sample
        self.total_steps = 0  # planned after the resume, from where the run stands
        self.schedule: LRSchedule | None = None
        self.lr = self.math.lr
        self.resume_notes: list[str] = []
        self.stopper = EarlyStopping(config.train.early_stopping)
        self.progress = Progress()
        self.resumed_from: int | None = None
        self.resume_point: ResumePoint | None = None
        self.last_validated: int | None = None
        self.val_metrics: dict[str, float] = {}
        self.model: DistributedDataParallel | None = None
        self.clock = clock_for(device)
        self.grad_norm: torch.Tensor | None = None
        self.flops_per_sample: float | None = getattr(module, "flops_per_sample", None)
        self.device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        self.peak_flops = peak_flops(config.metrics, self.device_name)
        shape = RunShape(
            self.math.global_batch,
            config.train.epochs,
            self.flops_per_sample,
            self.peak_flops,
            config.metrics.history_file,
        )
        self.progress_log = ProgressLog(context, device, logger, metrics, shape)

    # ----- lifecycle -------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Resume if possible, train to the end, test, and return the summary. However the
        run ends (a SIGTERM included), rank 0 first lets the checkpoint in flight finish."""
        try:
            return self._run()
        finally:
            self.writer.close(self.config.checkpoint.drain_timeout_s)

    def _run(self) -> dict[str, Any]:
        self.snapshots = self._snapshot_dir()
        self._restore()
        self._plan()
        self.writer.start(self.snapshots)
        self.model = DistributedDataParallel(
            self.module, device_ids=[self.device.index] if self.device.type == "cuda" else None
        )
        lap_when_backward_ends(self.module, self.clock)
        self._banner()
        self.metrics.progress(
            {
                "global_batch": self.math.global_batch,
                "world_size": self.context.world_size,
                "restart_count": self.context.restart_count,
                "epoch": self.progress.epoch + 1,
                "peak_flops": self.peak_flops or None,
                "checkpoint_every_steps": self.config.checkpoint.every_steps,
                "snapshot_every_steps": self.snapshot_every if self.snapshot_every else None,
                "recovery_lost_steps": self.resume_point and self.resume_point.lost_steps,
            }
        )
        started = time.perf_counter()
        if self._finished():
            event(
                self.log,
                "already_complete",
                f"run already complete at step {self.progress.step}; testing only",
            )
            if self.resume_point is not None and self.resume_point.snapshot_rank is not None:
                self._save(wait_s=self.solo_budget_s)  # the store lacks the final step
        else:
            self._fit()
        if self.last_validated != self.progress.step:
            self._validate()
        if not self.writer.wait(self.solo_budget_s):
            self.log.warning("the last checkpoint write is still running; testing meanwhile")
        self._drop_snapshots_once_durable()
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
        event(self.log, "summary", summary_line(summary), **summary)
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
            "device_name": self.device_name,
            "backend": dist.get_backend(),
            "amp": cfg.train.amp,
            "global_batch": self.math.global_batch,
            "lr": self.math.lr,
            "dataset": cfg.data.name,
            "train_samples": len(self.splits.train),
            "tokens_per_sample": self.splits.spec.tokens_per_sample,
            "model": cfg.model.name,
            "parameters": params,
            "flops_per_sample": self.flops_per_sample,
            "peak_flops_per_device": self.peak_flops or None,
            "steps_per_epoch": self.steps_per_epoch,
            "total_steps": self.total_steps,
            "checkpoint_uri": self.checkpointer.store.uri,
            "resumed_from_step": self.resumed_from,
        }
        nodes = plural(ctx.num_nodes, "node")
        procs = plural(ctx.local_world_size, "process", "processes")
        event(
            self.log,
            "start",
            f"rank 0 on host {ctx.hostname}: world size {ctx.world_size} ({nodes} x {procs}), "
            f"device {self.device} ({fields['backend']}), run id {ctx.run_id}, restart {ctx.restart_count}",
            **fields,
        )
        event(self.log, "batch_math", self.math.describe(), **self.math.as_fields())
        for note in self.resume_notes:
            event(self.log, "resume_change", note)
        point = self.resume_point
        event(
            self.log,
            "plan",
            f"{cfg.model.name} ({params:,} params) on {cfg.data.name} "
            f"({len(self.splits.train)} train samples): "
            f"{self.steps_per_epoch} steps/epoch, {self.total_steps} steps; checkpoints in "
            f"{self.checkpointer.store.uri}" + (f", {point.describe()}" if point is not None else ""),
            resumed_from=None if point is None else point.step,
            resume_origin=None if point is None else point.origin,
            lost_steps=None if point is None else point.lost_steps,
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
        self.stop.start_training(self.device)
        self.clock.lap(None)  # the set-up before the first step is no step's
        try:
            with bar, logging_redirect_tqdm(loggers=[self.log]):
                while not self._finished():
                    self._train_epoch(bar, window)
                self._report_progress()
        except Stopped as stopped:
            self._save_at_stop(stopped)
            raise
        finally:
            self.stop.stop_training()

    def _save_at_stop(self, stopped: Stopped) -> None:
        """Every rank stopped at this step: save it, and rank 0 waits until it is published
        or torchrun's shutdown deadline nears. One line says which."""
        self._report_progress()
        step = self.progress.step
        if self.last_saved_step != step:
            self._save(wait_s=self._stop_budget())
        if not self.context.is_main:
            return
        published = self.writer.wait(self._stop_budget())
        stats = self.writer.stats
        during = self.stop.received_during
        stopped_at = f"stopped by {stopped} at step {step}" + (
            f" (signal during step {during})" if during is not None else " (a peer's signal)"
        )
        if published and stats.last_success_step == step:
            location = self.checkpointer.store.location(step)
            event(self.log, "stopped", f"{stopped_at}: saved {location}", step=step, signal_step=during)
        else:
            why = "its write failed" if published else "its write did not finish before the shutdown deadline"
            newest = stats.last_success_step
            self.log.error("%s: NOT saved (%s); the newest checkpoint is step %s", stopped_at, why, newest)

    def _stop_budget(self) -> float:
        """Seconds left for the stop's checkpoint: torchrun's SIGKILL deadline, and no longer
        than peers may wait in a collective."""
        return min(self.stop.write_budget(), self.solo_budget_s)

    def _train_epoch(self, bar: tqdm, window: Window) -> None:
        progress, train = self.progress, self.config.train
        self.sampler.set_epoch(progress.epoch)
        self.sampler.resume_at(progress.epoch_position)
        steps = self._steps_left_in_epoch()
        if steps == 0:  # no full global batch left: a resume at more ranks near the epoch's end
            with lapped(self.clock, None):
                self._end_epoch()
            if self._finished():
                with lapped(self.clock, CHECKPOINT):
                    self._save(wait_s=self.solo_budget_s)
            return
        batches = iter(self.loader)
        samples_per_step = self.math.global_batch
        for index in range(steps):
            started = time.perf_counter()
            self.clock.lap(LOGGING)
            micro_batches = [next(batches) for _ in range(train.grad_accum_steps)]
            self.clock.lap(DATA)
            result = train_step(
                self.model,
                micro_batches,
                self.optimizer,
                self.scaler,
                amp=train.amp,
                clip_grad_norm=train.clip_grad_norm,
                clock=self.clock,
            )
            self.clock.end_step()
            progress.step += 1
            progress.epoch_position += samples_per_step
            progress.samples += samples_per_step
            self.lr = self.schedule.apply(self.optimizer, progress.samples)
            if self.snapshots is not None:
                self.snapshots.mark(progress.step)
            if result.grad_norm is not None:
                self.grad_norm = result.grad_norm
            window.add(result.loss)
            self._account(window)
            bar.update(1)
            self.stop.poll(progress.step, time.perf_counter() - started)
            self._report_progress()
            if progress.step % self.config.log.every_steps == 0 or progress.step == self.total_steps:
                self._gather_progress(window)
            epoch_done = index == steps - 1
            if epoch_done:
                self._report_progress()
                with lapped(self.clock, None):
                    self._end_epoch()
            finished = self._finished()
            every = self.config.checkpoint.every_steps
            durable = finished or bool(every and progress.step % every == 0)
            if durable or (self.snapshot_every and progress.step % self.snapshot_every == 0):
                self._report_progress()
                with lapped(self.clock, CHECKPOINT):
                    self._save(wait_s=self.solo_budget_s, durable=durable)
            if epoch_done or finished:
                return

    def _account(self, window: Window, *, wait: bool = False) -> None:
        """Hand the steps whose time the clock has resolved to the metrics and the window."""
        for seconds in self.clock.resolved(wait=wait):
            self.metrics.step(seconds, samples=self.samples_per_rank, tokens=self.tokens_per_rank)
            window.add_times(seconds)

    def _steps_left_in_epoch(self) -> int:
        """Full optimizer steps left in the sampler's epoch, at this world size."""
        return len(self.sampler) // self.samples_per_rank

    def _plan(self) -> None:
        """The step the run will end at and its LR schedule, from where it stands at this world
        size: what is left of this epoch, the epochs after it, `train.max_steps`."""
        progress, train = self.progress, self.config.train
        left = 0
        if not progress.stopped_early and progress.epoch < train.epochs:
            self.sampler.set_epoch(progress.epoch)
            self.sampler.resume_at(progress.epoch_position)
            left = self._steps_left_in_epoch() + (train.epochs - progress.epoch - 1) * self.steps_per_epoch
        end = progress.step + left
        if train.max_steps:
            end = min(end, max(train.max_steps, progress.step))
        self.total_steps = end
        batch = self.math.global_batch
        total_samples = progress.samples + (end - progress.step) * batch
        self.schedule = LRSchedule(self.math.lr, batch, total_samples, self.config.optim)
        self.lr = self.schedule.apply(self.optimizer, progress.samples)

    def _finished(self) -> bool:
        """Done by steps, by epochs or by early stopping; derived, so a resumed run with a
        larger `train.max_steps` or `train.epochs` carries on."""
        progress = self.progress
        return (
            progress.stopped_early
            or progress.step >= self.total_steps
            or progress.epoch >= self.config.train.epochs
        )

    def _gather_progress(self, window: Window) -> None:
        """Start gathering this window's progress line. At the last step every step's time
        is waited for, so the last line covers them all."""
        self._account(window, wait=self.progress.step == self.total_steps)
        self.progress_log.gather(
            window,
            step=self.progress.step,
            epoch=self.progress.epoch + 1,
            total_steps=self.total_steps,
            lr=self.lr,
            grad_norm=self.grad_norm,
            proposal=self._proposed_interval(window),
        )

    def _report_progress(self) -> None:
        """Read the gathered progress line, if one is on its way: rank 0 logs and exports
        it, and every rank takes rank 0's snapshot interval."""
        proposal = self.progress_log.read()
        if proposal is None:
            return
        self._apply_interval(proposal)
        if self.context.is_main:
            self.metrics.checkpoints(self.writer.stats)

    def _proposed_interval(self, window: Window) -> int:
        """With snapshot_every_steps=auto, rank 0's choice of interval from this window's
        save pauses, its writer's time per snapshot and the step time (sent to every rank in
        the progress gather, so that all switch at the same step)."""
        stats = self.writer.stats
        if not (self.pacer and window.saves and window.timed_steps and stats.last_snapshot_seconds):
            return self.snapshot_every
        pause_s = window.seconds[CHECKPOINT] / window.saves
        step_s = (sum(window.seconds) - window.seconds[CHECKPOINT]) / window.timed_steps
        return self.pacer.propose(self.snapshot_every, pause_s, stats.last_snapshot_seconds, step_s)

    def _apply_interval(self, interval: int) -> None:
        """Every rank takes rank 0's proposed snapshot interval at the same step."""
        if interval == self.snapshot_every:
            return
        self.snapshot_every = interval
        if self.pacer is not None and self.pacer.costs is not None:  # rank 0, which chose it
            pause, writer, step = (round(1000 * seconds, 2) for seconds in self.pacer.costs)
            event(
                self.log,
                "snapshot_interval",
                f"snapshots every {interval} steps (auto): a snapshot pauses training {pause} ms "
                f"and takes the writer {writer} ms; a step takes {step} ms",
                snapshot_every_steps=interval,
                pause_ms=pause,
                writer_ms=writer,
                step_ms=step,
            )
        self.metrics.progress({"snapshot_every_steps": interval})

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

    def _save(self, wait_s: float, *, durable: bool = True) -> None:
        """Every rank contributes its RNG state; rank 0 writes the durable checkpoint if
        `durable`, and with snapshots on, every node's first rank its snapshot. Each waits
        at most `wait_s` for the writes before it."""
        if durable:
            self.last_saved_step = self.progress.step
        rng_states = self._gather_rng()
        if not (self.context.is_main and durable) and self.snapshots is None:
            return
        state = {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "progress": asdict(self.progress),
            "early_stopping": self.stopper.state_dict(),
            "rng": rng_states,
            "config": to_tree(self.config),
            "world_size": self.context.world_size,
        }
        self.writer.save(
            state,
            step=self.progress.step,
            epoch=self.progress.epoch,
            world_size=self.context.world_size,
            durable=durable,
            wait_s=wait_s,
        )

    def _gather_rng(self) -> torch.Tensor:
        """Every rank's RNG streams, `[world_size, rng.PACKED_BYTES]`, on every rank: one
        fixed-size collective (not a pickled object gather: ~5x slower), so that any node can
        write a snapshot that resumes each rank."""
        local = rng.pack().to(self.device)
        gathered = torch.empty(self.context.world_size * local.numel(), dtype=torch.uint8, device=self.device)
        dist.all_gather_single(gathered, local)  # the concatenated form: gloo takes no other
        return gathered.view(self.context.world_size, -1).cpu()

    def _snapshot_dir(self) -> SnapshotDir | None:
        """This node's snapshots (its first rank only), when they are on and fit: the
        lineage comes from rank 0, and a snapshot directory without room for two is one
        line and no snapshots."""
        if not self.snapshot_every:
            return None
        lineage = broadcast_object(self.lineage)
        if not self.context.is_node_main:
            return None
        snapshots = SnapshotDir(self.config.checkpoint, str(lineage))
        try:
            snapshots.remove_other_lineages()
            problem = snapshots.room_for(self._state_bytes())
        except OSError as error:
            problem = f"{self.config.checkpoint.snapshot_dir} is not usable ({error.strerror})"
        if problem:
            self.log.warning(
                "snapshots off on %s: %s; raise its size or set checkpoint.snapshot_dir",
                self.context.hostname, problem,
            )  # fmt: skip
            return None
        return snapshots

    def _state_bytes(self) -> int:
        """The size of a saved state: weights and buffers, and the optimizer's per-parameter
        state (AdamW's two moments, SGD's momentum), which exists only after a first step."""
        weights = sum(t.numel() * t.element_size() for t in self.module.state_dict().values())
        params = sum(p.numel() * p.element_size() for p in self.module.parameters())
        optim = self.config.optim
        slots = 2 if optim.name == "adamw" else int(optim.momentum > 0)
        return weights + slots * params + 2**20

    def _drop_snapshots_once_durable(self) -> None:
        """At the end of a run whose final step the store holds, the node-local snapshots
        are redundant memory: every node's first rank removes them."""
        if not self.snapshot_every:
            return
        durable = self.context.is_main and self.writer.stats.last_success_step == self.progress.step
        if broadcast_flag(durable, self.device) and self.snapshots is not None:
            self.writer.close(self.solo_budget_s)
            self.snapshots.remove()

    def _restore(self) -> None:
        """Agree on the newest intact step among the nodes' snapshots and the store, and
        load it on every rank: model, optimizer, scaler, early stopping, progress and each
        rank's RNG streams. The LR is not restored but derived (`_plan`); changed settings
        are applied and reported, or refused."""
        point, state = recover(
            self.checkpointer, self.snapshots, self.context, self.device, self.config.dist.timeout_s / 2
        )
        if point is None:
            return
        step, uri = point.step, self.checkpointer.store.uri
        changes = config_changes(state["config"], self.config, step, uri)
        try:
            self.module.load_state_dict(state["model"])
        except RuntimeError as error:
            detail = str(error).splitlines()[1].strip() if "\n" in str(error) else str(error)
            raise CheckpointError(
                "checkpoint.uri",
                uri,
                f"step {step} holds a different model than model.name={self.config.model.name} ({detail})",
            ) from None
        self.optimizer.load_state_dict(state["optimizer"])
        apply_hyperparameters(self.optimizer, self.config.optim)
        self.scaler.load_state_dict(state["scaler"])
        self.stopper.load_state_dict(state["early_stopping"])
        saved_config = from_tree(state["config"])
        saved = batch_math(saved_config.train, saved_config.optim, state["world_size"])
        progress = {"samples": state["progress"]["step"] * saved.global_batch, **state["progress"]}
        self.progress = Progress(**progress)
        if state["world_size"] == self.context.world_size:
            rng.restore(state["rng"][self.context.rank])
        else:
            rng.seed_everything(self.config.seed + 1_000_003 * (step + 1) + self.context.rank)
        self.resumed_from, self.resume_point = step, point
        if point.snapshot_rank is None:
            self.writer.stats.last_success_step = step
            self.checkpointer.protected.add(step)
        self.resume_notes = [f"changed since step {step}, applied: {change}" for change in changes]
        if saved.global_batch != self.math.global_batch:
            self.resume_notes.append(
                f"step {step} was saved at world size {saved.world_size}, global batch "
                f"{saved.global_batch}, lr {saved.lr:.6g}; this run trains at world size "
                f"{self.context.world_size}, global batch {self.math.global_batch}, lr {self.math.lr:.6g}"
            )


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
