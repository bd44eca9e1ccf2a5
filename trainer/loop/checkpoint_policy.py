"""When a run saves and what it saves to: rank 0's durable checkpoints every
`checkpoint.every_steps` and at the end, every node's snapshots on their own (auto-paced)
interval, and the snapshots' removal once the store holds the final step."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from trainer.checkpoint import rng
from trainer.checkpoint.manager import Checkpointer
from trainer.checkpoint.recovery import ResumePoint, recover
from trainer.checkpoint.snapshots import AUTO_FIRST, SnapshotDir, SnapshotPacer
from trainer.checkpoint.writer import CheckpointWriter
from trainer.checkpoint.writer_start import WriterHandle
from trainer.config import CheckpointConfig, Config
from trainer.distributed.process_group import DistContext, broadcast_flag, broadcast_object
from trainer.loop.preemption import Stopped, StopSignal, report_stop
from trainer.loop.training_state import Restored, TrainingState
from trainer.telemetry.checkpoint_stats import CheckpointStats
from trainer.telemetry.log import event
from trainer.telemetry.metrics import Metrics
from trainer.telemetry.progress import Window
from trainer.telemetry.timing import CHECKPOINT


class NotDurable(Exception):
    """The run ended without the store holding its newest state: it must not exit 0 (the
    operator would mark the job Succeeded and delete the pods, snapshots and all)."""

    exit_code = 1  # a failed worker: torchrun restarts it, ddp-launch relaunches it

    def __init__(self, step: int) -> None:
        super().__init__(f"step {step} is not saved")
        self.step = step


def describe_holders(holders: list[tuple[str, int]]) -> str:
    """Where the state newer than the store's is: `in the snapshots on pod-0 (step 90)`."""
    if not holders:
        return "nowhere else: no snapshot holds it"
    return "in the snapshots on " + ", ".join(f"{host} (step {step})" for host, step in holders)


class CheckpointPolicy:
    """One rank's side of saving: which steps are saved, the collective every save needs
    (each rank's RNG streams), and the hand-over to its writer if this rank writes."""

    def __init__(
        self,
        config: CheckpointConfig,
        context: DistContext,
        device: torch.device,
        checkpointer: Checkpointer,
        logger: logging.Logger,
        metrics: Metrics,
        *,
        lineage: str | None,
        writer_process: WriterHandle | None,
    ) -> None:
        """`lineage` is the store's history id, known to rank 0 (see `Checkpointer.lineage`);
        `writer_process` the writer spawned early for this rank, if it writes anything."""
        self.config, self.context, self.device = config, context, device
        self.checkpointer, self.log, self.metrics, self.lineage = checkpointer, logger, metrics, lineage
        every = config.snapshot_every_steps
        self.pacer = SnapshotPacer() if every == "auto" else None
        self.snapshot_every = AUTO_FIRST if every == "auto" else every
        self.snapshots: SnapshotDir | None = None
        self.last_durable_step: int | None = None
        self.last_save_step = 0  # the last save's, durable or snapshot only (0: none this run)
        self._waited_s = 0.0  # the writer's wait_seconds_total at the last interval proposal
        self.writer = CheckpointWriter(
            checkpointer if context.is_main else None,
            config,
            logger,
            cache=checkpointer.cache,
            snapshots=context.is_node_main and self.snapshot_every > 0,
            process=writer_process,
        )

    @property
    def stats(self) -> CheckpointStats:
        return self.writer.stats

    @property
    def write_in_flight(self) -> bool:
        """Whether this rank's writer is still busy with an earlier save."""
        return self.writer.busy

    def open_snapshots(self, state_bytes: int) -> None:
        """This node's snapshots (its first rank only), when they are on and fit: the
        lineage comes from rank 0, and a snapshot directory without room for two is one
        line and no snapshots. Every rank calls it (a collective)."""
        if not self.snapshot_every:
            return
        lineage = broadcast_object(self.lineage)
        if not self.context.is_node_main:
            return
        snapshots = SnapshotDir(self.config, str(lineage))
        try:
            snapshots.remove_other_lineages()
            problem = snapshots.room_for(state_bytes)
        except OSError as error:
            problem = f"{self.config.snapshot_dir} is not usable ({error.strerror})"
        if problem:
            self.log.warning(
                "snapshots off on %s: %s; raise its size or set checkpoint.snapshot_dir",
                self.context.hostname, problem,
            )  # fmt: skip
            return
        self.snapshots = snapshots

    def start(self) -> None:
        self.writer.start(self.snapshots)

    def restore(
        self, state: TrainingState, config: Config, budget_s: float
    ) -> tuple[ResumePoint, Restored] | None:
        """Agree on the newest intact step among the nodes' snapshots and the store, load it
        on every rank (`TrainingState.load`), and count the next saves from it; None when
        there is none. `budget_s` bounds what rank 0 does alone meanwhile."""
        point, tree = recover(self.checkpointer, self.snapshots, self.context, self.device, budget_s)
        if point is None:
            return None
        restored = state.load(tree, config, self.context, point.step, self.checkpointer.store.uri)
        if point.lost_steps is None and restored.complete:  # no step came after the run's last
            point = dataclasses.replace(point, lost_steps=0)
        self._resumed(point.step, from_store=point.snapshot_rank is None)
        return point, restored

    def _resumed(self, step: int, *, from_store: bool) -> None:
        """The run resumed from `step`: the next snapshot is counted from it, and a step from
        the store is saved, and never deleted by retention. Resumed from a snapshot, rank 0
        still knows the store's newest step (what `latest.json` names), for its lines."""
        self.last_save_step = step
        if from_store:
            self.stats.last_success_step = step
            self.checkpointer.protected.add(step)
        elif self.context.is_main:
            self.stats.last_success_step = self.checkpointer.committed_step()

    def mark(self, step: int) -> None:
        """Record `step` as this node's last completed one (its snapshot folder's counter)."""
        if self.snapshots is not None:
            self.snapshots.mark(step)

    def durable_due(self, step: int, finished: bool) -> bool:
        every = self.config.every_steps
        return finished or bool(every and step % every == 0)

    def snapshot_due(self, step: int) -> bool:
        """A fixed interval N snapshots at multiples of N; `auto` counts its interval from the
        last save, so that a switch to a shorter one never puts two snapshots closer than it."""
        if not self.snapshot_every:
            return False
        if self.pacer is not None:
            return step - self.last_save_step >= self.snapshot_every
        return step % self.snapshot_every == 0

    def save(
        self,
        state: Callable[[torch.Tensor], dict[str, Any]],
        *,
        step: int,
        epoch: int,
        wait_s: float,
        durable: bool = True,
        patient: bool = True,
    ) -> None:
        """Every rank contributes its RNG state; rank 0 writes the durable checkpoint if
        `durable`, and with snapshots on, every node's first rank its snapshot. `state`
        builds the saved tree around the gathered RNG streams, only on a rank that writes.
        Each waits at most `wait_s` for the writer to take the state before (`patient`:
        even while saves are being skipped; see CheckpointWriter.save)."""
        if durable:
            self.last_durable_step = step
        self.last_save_step = step
        rng_states = self._gather_rng()
        if not (self.context.is_main and durable) and self.snapshots is None:
            return
        world_size = self.context.world_size
        self.writer.save(
            state(rng_states), step=step, epoch=epoch, world_size=world_size, durable=durable, wait_s=wait_s,
            patient=patient,
        )  # fmt: skip

    def _gather_rng(self) -> torch.Tensor:
        """Every rank's RNG streams, `[world_size, rng.PACKED_BYTES]`, on every rank."""
        return self.gather(rng.pack())

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's `local` (the same size on each), `[world_size, numel]` on every rank:
        one fixed-size collective (not a pickled object gather: ~5x slower), so that any node
        can write a snapshot that resumes each rank."""
        local = local.flatten().to(self.device)
        gathered = torch.empty(self.context.world_size * local.numel(), dtype=local.dtype, device=self.device)
        dist.all_gather_single(gathered, local)  # the concatenated form: gloo takes no other
        return gathered.view(self.context.world_size, -1).cpu()

    def proposed_interval(self, window: Window) -> int:
        """With snapshot_every_steps=auto, rank 0's choice of interval from this window's
        save pauses, its writer's time per snapshot and the step time (sent to every rank in
        the progress gather, so that all switch at the same step)."""
        stats = self.stats
        waited_s, self._waited_s = stats.wait_seconds_total - self._waited_s, stats.wait_seconds_total
        if not (self.pacer and window.saves and window.timed_steps and stats.last_snapshot_seconds):
            return self.snapshot_every
        # a snapshot's cost is its pause: time spent waiting for a writer that had not taken the
        # state before is the writer's slowness (a skipped save's included), not what it costs
        pause_s = max(0.0, window.seconds[CHECKPOINT] - waited_s) / window.saves
        step_s = (sum(window.seconds) - window.seconds[CHECKPOINT]) / window.timed_steps
        return self.pacer.propose(self.snapshot_every, pause_s, stats.last_snapshot_seconds, step_s)

    def apply_interval(self, interval: int) -> None:
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

    def wait(self, timeout_s: float) -> bool:
        """Wait for the write in flight; False if it is still running after `timeout_s`."""
        return self.writer.wait(timeout_s)

    def is_durable(self, step: int) -> bool:
        """Whether the store holds `step`, as rank 0 knows it, on every rank. A collective."""
        return broadcast_flag(self.context.is_main and self.stats.last_success_step == step, self.device)

    def drop_snapshots(self, timeout_s: float) -> None:
        """At the end of a run whose final step the store holds, the node-local snapshots
        are redundant memory: every node's first rank removes them."""
        if self.snapshots is not None:
            self.writer.close(timeout_s)
            self.snapshots.remove()

    def snapshot_holders(self, timeout_s: float) -> list[tuple[str, int]]:
        """Every node's host and newest snapshot step, once the snapshot in flight is written
        (for up to `timeout_s`), on rank 0. A collective."""
        held = None
        if self.snapshots is not None:
            self.writer.wait_staged(timeout_s)
            held = self.stats.last_snapshot_step
        mine = (self.context.hostname, held)
        everyone: list[tuple[str, int | None]] = [mine] * self.context.world_size
        dist.all_gather_object(everyone, mine)
        return sorted({(host, step) for host, step in everyone if step is not None})

    def report_not_durable(self, step: int, timeout_s: float) -> NotDurable:
        """Every rank: the run's end, whose newest state the store lacks. Rank 0 says in one
        line what the store holds and where the newer state still is."""
        where = describe_holders(self.snapshot_holders(timeout_s))
        if self.context.is_main:
            self.log.error(
                "step %d is NOT saved: %s holds step %s at newest; the newer state is %s. Exit %d: "
                "a restart resumes from the snapshots and saves again once the store takes writes",
                step, self.checkpointer.store.uri, self.stats.last_success_step, where, NotDurable.exit_code,
            )  # fmt: skip
        return NotDurable(step)

    def newest_location(self, step: int) -> str | None:
        """The store's newest checkpoint as rank 0 knows it (`step` on the other ranks)."""
        newest = self.stats.last_success_step if self.context.is_main else step
        return None if newest is None else self.checkpointer.store.location(newest)

    def close(self, timeout_s: float) -> None:
        self.writer.close(timeout_s)

    def report_at_stop(self, stopped: Stopped, step: int, stop: StopSignal, cap_s: float) -> None:
        """After a stop's save at `step`: find which nodes hold its snapshot, and rank 0 waits
        for its upload within what is left of the stop's budget (at most `cap_s`, as long as
        peers may wait in a collective), then says in one line where the state is."""
        holders = self.snapshot_holders(min(stop.write_budget(), cap_s))
        if not self.context.is_main:
            return
        published = self.wait(min(stop.write_budget(), cap_s))
        report_stop(
            self.log,
            stopped,
            step,
            stop.received_during,
            published=published,
            newest_step=self.stats.last_success_step,
            location=self.checkpointer.store.location(step),
            elsewhere=describe_holders(holders),
        )
