"""The training loop: resume, train with periodic logs and checkpoints, validate, stop, test.

What is saved and when lives in `trainer.loop.checkpoint_policy`, what a checkpoint holds in
`trainer.loop.training_state`, the run's end and schedule in `trainer.loop.plan`, the
start lines in `trainer.loop.banner` and the stop at a signal in
`trainer.loop.preemption`; this module strings them together."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from trainer.checkpoint.manager import Checkpointer
from trainer.checkpoint.recovery import ResumePoint
from trainer.checkpoint.writer_start import WriterHandle
from trainer.config import Config
from trainer.config.registry import DATASETS
from trainer.data import DataSplits, train_loader
from trainer.data.device_prefetch import on_device
from trainer.data.identity import DataIdentity
from trainer.distributed import heartbeat as phases
from trainer.distributed.heartbeat import Heartbeat
from trainer.distributed.process_group import DistContext, broadcast_flag, broadcast_object
from trainer.loop.banner import RunFacts, announce_start, announce_startup
from trainer.loop.checkpoint_policy import CheckpointPolicy
from trainer.loop.compiled_run import CompiledRun
from trainer.loop.ddp import wrap
from trainer.loop.evaluate import Evaluator
from trainer.loop.optim import LRSchedule, batch_math, build_optimizer
from trainer.loop.plan import Progress, finished, plan, steps_per_epoch
from trainer.loop.preemption import LEASE_LOST, Stopped, StopSignal
from trainer.loop.step import train_step
from trainer.loop.training_state import Restored, TrainingState
from trainer.telemetry.log import event
from trainer.telemetry.metrics import Metrics, peak_flops
from trainer.telemetry.progress import (
    ProgressLog,
    RunShape,
    Window,
    logs_above_the_bar,
    progress_bar,
    summary_line,
)
from trainer.telemetry.startup import STARTUP
from trainer.telemetry.timing import CHECKPOINT, DATA, LOGGING, clock_for, lap_when_backward_ends, lapped


class Trainer:
    """Owns the model, optimizer, schedule, loaders and checkpoints of one run."""

    def __init__(
        self,
        config: Config,
        context: DistContext,
        device: torch.device,
        splits: DataSplits,
        data: DataIdentity,
        module: nn.Module,
        checkpointer: Checkpointer,
        logger: logging.Logger,
        metrics: Metrics,
        stop: StopSignal,
        heartbeat: Heartbeat,
        lineage: str | None = None,
        writer_process: WriterHandle | None = None,
    ) -> None:
        """`lineage` is the store's history id, known to rank 0 (see `Checkpointer.lineage`);
        `writer_process` the writer spawned early for this rank, if it writes anything.
        `heartbeat` is this rank's progress record, for the node's watchdog."""
        self.config, self.context, self.device = config, context, device
        self.splits, self.checkpointer, self.log, self.metrics = splits, checkpointer, logger, metrics
        self.stop, self.heartbeat = stop, heartbeat
        # what rank 0 or one node may spend alone while its peers wait in a collective
        self.solo_budget_s = config.dist.timeout_s / 2
        self.save_wait_s = min(config.checkpoint.save_wait_s, self.solo_budget_s)
        self.checkpoints = CheckpointPolicy(
            config.checkpoint,
            context,
            device,
            checkpointer,
            logger,
            metrics,
            lineage=lineage,
            writer_process=writer_process,
        )
        self.module = module.to(device)
        self.math = batch_math(config.train, config.optim, context.world_size)
        self.optimizer = build_optimizer(self.module, config.optim, self.math.lr)
        self.evaluator = Evaluator(self.module, splits, config, context, device, heartbeat, metrics, logger)
        self.state = TrainingState.of(self.module, self.optimizer, config, device, data)
        self.scaler, self.stopper, self.powersgd = self.state.scaler, self.state.stopper, self.state.powersgd
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
        self.progress = Progress()
        self.total_steps = 0  # planned after the resume, from where the run stands
        self.schedule: LRSchedule | None = None
        self.lr = self.math.lr
        self.resume_point: ResumePoint | None = None
        self.restored = Restored(self.progress)  # what a resume loaded and changed
        self.model: DistributedDataParallel | None = None
        self.clock = clock_for(device)
        self.grad_norm: torch.Tensor | None = None
        self.flops_per_sample: float | None = getattr(module, "flops_per_sample", None)
        self.device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        self.peak_flops = peak_flops(config.metrics, self.device_name)
        store = checkpointer.store
        self.compiled = CompiledRun(config, store, self.device_name, context, heartbeat, logger)
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
            # in a phase of its own: after a signal the step's phase and limit would be back
            drain_s = self.config.checkpoint.drain_timeout_s
            with self.heartbeat.phase(phases.FINISH, limit_s=drain_s + self.solo_budget_s):
                self.checkpoints.close(drain_s)
                self.compiled.wait(drain_s)  # the compile cache's upload, if one runs

    def _run(self) -> dict[str, Any]:
        self.checkpoints.open_snapshots(self.state.size_bytes(self.config.optim, self.context.world_size))
        with self.heartbeat.phase(phases.RESUME):
            self._restore()
            self.heartbeat.resumed_at(self.progress.step)
        STARTUP.mark("resume")
        self._plan()
        self.checkpoints.start()
        self.compiled.compile(self.module)  # the forward, in place: DDP wraps the compiled module
        self.model = wrap(self.module, self.device, self.config.ddp, self.powersgd)
        lap_when_backward_ends(self.module, self.clock)
        announce_start(
            self.log,
            self.metrics,
            self.config,
            self.context,
            self.math,
            RunFacts.of(self),
            self.resume_point,
            self.restored.notes,
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
        if self.evaluator.last_validated != self.progress.step:
            self.evaluator.validate(self.progress.step)
        with self.heartbeat.phase(phases.FINISH, limit_s=2 * self.solo_budget_s):  # rank 0 waits alone
            if not self.checkpoints.wait(self.solo_budget_s):
                self.log.warning("the last checkpoint write is still running after %.0fs", self.solo_budget_s)
            if not self.checkpoints.is_durable(self.progress.step):
                raise self.checkpoints.report_not_durable(self.progress.step, self.solo_budget_s)
            if self.checkpoints.snapshot_every:
                self.checkpoints.drop_snapshots(self.solo_budget_s)
        self.metrics.checkpoints(self.checkpoints.stats, self.progress.step)
        self.metrics.flush()
        test = self.evaluator.test()
        self.compiled.settle()
        summary = {
            "steps": self.progress.step,
            "epochs_completed": self.progress.epoch,
            "val_loss": self.evaluator.val_metrics.get("loss"),
            "val_accuracy": self.evaluator.val_metrics.get("accuracy"),
            "test_loss": test.get("loss"),
            "test_accuracy": test.get("accuracy"),
            "wall_seconds": round(time.perf_counter() - started, 3),
            "checkpoint": self.checkpoints.newest_location(self.progress.step),
        }
        event(self.log, "summary", summary_line(summary), **summary)
        return summary

    # ----- training ----------------------------------------------------------------------

    def _fit(self) -> None:
        bar = progress_bar(self.context, self.total_steps, self.progress.step)
        window = Window()
        self.stop.start_training(self.device)
        self.clock.lap(None)  # the set-up before the first step is no step's
        self.compiled.enter_first_step()
        try:
            with bar, logs_above_the_bar(bar, self.log):
                while not self._finished():
                    self._train_epoch(bar, window)
                self._report_progress()
        except Stopped as stopped:
            self._save_at_stop(stopped)
            raise
        finally:
            self.stop.stop_training()

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
        # a plug-in's error is its one line; on CUDA the next batch copies while a step runs
        batches = on_device(DATASETS.reading(self.config.data.name, iter(self.loader)), self.device)
        samples_per_step = self.math.global_batch
        for index in range(steps):
            started = time.perf_counter()
            self.clock.lap(LOGGING)
            micro_batches = [next(batches) for _ in range(train.grad_accum_steps)]
            self.clock.lap(DATA)
            with self.compiled:  # a compile that fails: one line
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
            self.heartbeat.beat(progress.step)
            if not STARTUP.reported:  # the first step's end: where the start-up's time went
                announce_startup(self.log, self.metrics, self.context.restart_count, self.compiled.on)
            progress.epoch_position += samples_per_step
            progress.samples += samples_per_step
            self.lr = self.schedule.apply(self.optimizer, progress.samples)
            self.checkpoints.mark(progress.step)
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
            done = self._finished()
            durable = self.checkpoints.durable_due(progress.step, done)
            if durable or self.checkpoints.snapshot_due(progress.step):
                self._report_progress()
                with lapped(self.clock, CHECKPOINT):  # the end's save may wait; no other does long
                    wait_s = self.solo_budget_s if done else self.save_wait_s
                    self._save(wait_s=wait_s, durable=durable, patient=done)
            if epoch_done or done:
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
        """The step the run will end at and its LR schedule, from where it stands."""
        self.sampler.set_epoch(self.progress.epoch)
        self.sampler.resume_at(self.progress.epoch_position)
        planned = plan(
            self.progress,
            self.config.train,
            self.config.optim,
            self.math,
            steps_left_in_epoch=self._steps_left_in_epoch(),
            steps_per_epoch=self.steps_per_epoch,
        )
        self.total_steps, self.schedule = planned.total_steps, planned.schedule
        self.lr = self.schedule.apply(self.optimizer, self.progress.samples)

    def _finished(self) -> bool:
        return finished(self.progress, self.total_steps, self.config.train.epochs)

    def _gather_progress(self, window: Window) -> None:
        """Start gathering this window's progress line. At the last step every step's time
        is waited for, so the last line covers them all."""
        self._account(window, wait=self.progress.step == self.total_steps)
        self.compiled.settle()
        self.progress_log.gather(
            window,
            step=self.progress.step,
            epoch=self.progress.epoch + 1,
            total_steps=self.total_steps,
            lr=self.lr,
            grad_norm=self.grad_norm,
            proposal=self.checkpoints.proposed_interval(window),
        )

    def _report_progress(self) -> None:
        """Read the gathered progress line, if one is on its way: rank 0 logs and exports
        it, and every rank takes rank 0's snapshot interval."""
        proposal = self.progress_log.read()
        if proposal is None:
            return
        self.checkpoints.apply_interval(proposal)
        if self.context.is_main:
            self.metrics.checkpoints(self.checkpoints.stats, self.progress.step)

    def _end_epoch(self) -> None:
        """Validate, let early stopping decide (rank 0's decision for all), move to the next epoch."""
        with self.compiled:
            metrics = self.evaluator.validate(self.progress.step)
        self.compiled.settle()
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

    # ----- saving and restoring --------------------------------------------------------

    def _save(self, wait_s: float, *, durable: bool = True, patient: bool = True) -> None:
        """This step's state to the writers: durable on rank 0, or only the snapshots. The
        pause may include waiting for the write in flight, for up to `wait_s`: the watchdog
        allows for that on top of a save's usual time."""
        config, world_size, progress = self.config, self.context.world_size, self.progress
        limit_s = self.heartbeat.limits.limit(phases.CHECKPOINT)
        if self.checkpoints.write_in_flight:
            limit_s += wait_s
        with self.heartbeat.phase(phases.CHECKPOINT, limit_s):
            errors = None if self.powersgd is None else self.checkpoints.gather(self.powersgd.local_errors())
            self.checkpoints.save(
                lambda rng_states: self.state.tree(progress, rng_states, config, world_size, errors),
                step=progress.step,
                epoch=progress.epoch,
                wait_s=wait_s,
                durable=durable,
                patient=patient,
            )

    def _save_at_stop(self, stopped: Stopped) -> None:
        """Every rank stopped at this step: save it, and rank 0 waits until it is published
        or torchrun's shutdown deadline nears (and no longer than peers may wait in a
        collective). One line says which."""
        self._report_progress()
        step = self.progress.step
        self.heartbeat.enter(phases.FINISH, limit_s=2 * self.solo_budget_s)
        if stopped.signum == LEASE_LOST:  # nothing to save: the store is another run's now
            self.stop.detail = broadcast_object(self.stop.detail)  # rank 0's, for every rank's line
            return
        if self.checkpoints.last_durable_step != step:
            self._save(wait_s=min(self.stop.write_budget(), self.solo_budget_s))
        self.checkpoints.report_at_stop(stopped, step, self.stop, self.solo_budget_s)

    def _restore(self) -> None:
        """Load the newest intact step of the snapshots and the store on every rank."""
        found = self.checkpoints.restore(self.state, self.config, self.solo_budget_s)
        if found is not None:
            self.resume_point, self.restored = found
            self.progress = self.restored.progress
