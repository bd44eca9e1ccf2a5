"""Where a (re)started run resumes from: the newest of every node's snapshot and the store.

At start, after the process group forms: each node's first rank finds the newest intact
snapshot it holds and the last step it completed, and all of them report in one
collective. Rank 0 looks in the store only for steps newer than the best snapshot (a
snapshot saves a download), decides, and says so to every rank. A snapshot's state goes
from its node to every rank through the process group (NCCL on GPUs, gloo on CPUs), as one
flat byte buffer; a store checkpoint is loaded from the store as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainer.checkpoint.manager import Checkpointer, CheckpointError
from trainer.checkpoint.resume import bounded, load_everywhere
from trainer.checkpoint.shared_state import aligned_slots, join_tensors, split_tensors
from trainer.checkpoint.snapshots import SnapshotDir
from trainer.checkpoint.writer_process import writer_lock
from trainer.distributed.process_group import DistContext, broadcast_object
from trainer.telemetry.log import plural


@dataclass(frozen=True)
class ResumePoint:
    """The step a run resumes from, where it comes from, and what the failure cost."""

    step: int
    origin: str  # "snapshot on <host>" or the store's URI
    snapshot_rank: int | None  # the rank whose node sends the snapshot; None: the store
    lost_steps: int | None  # the newest step any node completed, less `step`; None: unknown

    def describe(self) -> str:
        lost = "steps lost unknown" if self.lost_steps is None else plural(self.lost_steps, "step") + " lost"
        return f"resumed from step {self.step} ({self.origin}, {lost})"


@dataclass(frozen=True)
class _Report:
    snapshot_step: int | None
    reached: int | None
    host: str


def recover(
    checkpointer: Checkpointer,
    snapshots: SnapshotDir | None,
    context: DistContext,
    device: torch.device,
    budget_s: float,
) -> tuple[ResumePoint | None, dict[str, Any] | None]:
    """Agree on the resume point and load its state on every rank; (None, None) for a fresh
    start. `snapshots` is this node's, given on its first rank only."""
    held: tuple[int, dict[str, Any]] | None = None
    report = _Report(None, None, context.hostname)
    if context.is_node_main:
        with writer_lock(checkpointer.cache, budget_s):  # a killed attempt's writer finishes first
            if snapshots is not None:
                held = snapshots.newest()
                report = _Report(held[0] if held else None, snapshots.reached(), context.hostname)
    reports: list[_Report] = [report] * context.world_size
    dist.all_gather_object(reports, report)
    point = _decide(checkpointer, reports, context, budget_s) if context.is_main else None
    point = broadcast_object(point)
    if isinstance(point, CheckpointError):
        raise point
    if point is None:
        return None, None
    if point.snapshot_rank is None:
        return point, load_everywhere(checkpointer, context, point.step, budget_s)
    mine = held[1] if held is not None and context.rank == point.snapshot_rank else None
    return point, broadcast_state(mine, point.snapshot_rank, device)


def _decide(
    checkpointer: Checkpointer, reports: list[_Report], context: DistContext, budget_s: float
) -> ResumePoint | CheckpointError | None:
    """Rank 0: the newest snapshot, unless the store holds a newer intact step."""
    holders = [(r.snapshot_step, -rank) for rank, r in enumerate(reports) if r.snapshot_step is not None]
    best_step, best_rank = max(holders) if holders else (None, 0)
    reached = [r.reached for r in reports if r.reached is not None]
    uri = checkpointer.store.uri
    find = lambda: checkpointer.find_resumable(newer_than=best_step)  # noqa: E731
    try:
        stored = bounded("finding the resume step", budget_s, find, uri)
    except CheckpointError as error:
        return error
    except Exception as error:  # the store failing: said to every rank, not raised here alone
        return CheckpointError("checkpoint.uri", uri, f"finding the resume step failed: {error}")
    if stored is None and best_step is None:
        return None
    step = stored if stored is not None else best_step
    lost = max(reached) - step if reached and max(reached) >= step else None
    if stored is not None:
        return ResumePoint(step, uri, None, lost)
    rank = -best_rank
    return ResumePoint(step, f"snapshot on {reports[rank].host}", rank, lost)


def broadcast_state(state: dict[str, Any] | None, src: int, device: torch.device) -> dict[str, Any]:
    """`src`'s state on every rank, on the CPU: the tree as one pickled object, the tensors'
    bytes as one buffer broadcast on `device`."""
    tensors: list[torch.Tensor] = []
    skeleton = split_tensors(state, tensors) if dist.get_rank() == src else None
    layout = [(tensor.dtype, tuple(tensor.shape)) for tensor in tensors]
    holder = [(skeleton, layout)]
    dist.broadcast_object_list(holder, src=src)
    skeleton, layout = holder[0]
    slots, total = aligned_slots(layout)
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    if dist.get_rank() == src:
        for tensor, slot in zip(tensors, slots, strict=True):
            flat = tensor.contiguous().reshape(-1).view(torch.uint8)
            buffer[slot.offset : slot.offset + slot.nbytes].copy_(flat)
    dist.broadcast(buffer, src=src)
    received = [
        buffer[slot.offset : slot.offset + slot.nbytes].view(dtype).view(shape).to("cpu", copy=True)
        for (dtype, shape), slot in zip(layout, slots, strict=True)
    ]
    return join_tensors(skeleton, received)
