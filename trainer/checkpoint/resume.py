"""Finding, agreeing on and checking the step a run resumes from.

Every decision here is made once and seen by every rank (a broadcast or a gather), so that
no rank takes a branch its peers do not and leaves them waiting in a collective. Work that
rank 0 or a node's first rank does alone, while its peers wait, is bounded well below the
collective timeout; a store too slow for it is a one-line error naming the phase.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from trainer.checkpoint.manager import Checkpointer, CheckpointError
from trainer.config import Config, DataConfig, to_tree
from trainer.data.identity import DataIdentity
from trainer.distributed.process_group import DistContext, broadcast_object

T = TypeVar("T")

# changing these cannot be applied to a checkpoint's state: its tensors have their shape,
# its optimizer state its kind (SGD's momentum buffers are not AdamW's moments)
REFUSED = ("model.name", "model.width", "model.depth", "model.heads", "model.options", "optim.name")
# what is reported when it changed, and applied: the run's length, LR and batch arithmetic,
# what DDP sends (a PowerSGD state of another hook is left unused)
REPORTED = ("train.", "optim.", "model.dropout", "data.", "ddp.", "seed")


def bounded(phase: str, budget_s: float, work: Callable[[], T], uri: str) -> T:
    """Run `work` on a thread and give up after `budget_s`: what a rank does alone while its
    peers wait in a collective must end before their timeout does."""
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            outcome["value"] = work()
        except BaseException as error:  # handed to the caller
            outcome["error"] = error
        finally:
            done.set()

    threading.Thread(target=target, name=phase, daemon=True).start()
    if not done.wait(budget_s):
        raise CheckpointError(
            "checkpoint.uri",
            uri,
            f"{phase} took longer than {budget_s:.0f}s, half of dist.timeout_s; the store is too slow "
            "for it: raise dist.timeout_s or check the store's health",
        )
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def load_everywhere(
    checkpointer: Checkpointer, context: DistContext, step: int, budget_s: float
) -> dict[str, Any]:
    """Every rank loads `step` (one download per node); if any rank cannot, all raise the
    same error naming it, rather than one raising while the others wait."""
    uri = checkpointer.store.uri
    state: dict[str, Any] | None = None
    problem = ""
    if context.is_node_main and not context.is_main:  # rank 0 fetched it while finding it
        try:
            fetch = lambda: checkpointer.fetch_verified(step)  # noqa: E731
            if not bounded(f"downloading step {step}", budget_s, fetch, uri):
                problem = "it does not verify on this node"
        except Exception as error:  # a slow or failing store, said in the error
            problem = error.allowed if isinstance(error, CheckpointError) else str(error)
    dist.barrier()
    if not problem:
        try:
            state = checkpointer.load(step)
        except Exception as error:  # unreadable here, whatever the reason
            problem = error.allowed if isinstance(error, CheckpointError) else str(error)
    problem = f"rank {context.rank} on {context.hostname}: {problem}" if problem else ""
    problems = [""] * context.world_size
    dist.all_gather_object(problems, problem)
    if context.is_node_main:
        checkpointer.release(step)
    failed = [text for text in problems if text]
    if failed:
        raise CheckpointError("checkpoint.uri", uri, f"step {step} cannot be resumed: {failed[0]}")
    return state


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and not name.endswith("options"):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def config_changes(saved: dict[str, Any], config: Config, step: int, uri: str) -> list[str]:
    """`key old -> new` for each training setting that changed since `step` was saved;
    raises for a change the checkpoint's state cannot take."""
    before, now = flatten(saved), flatten(to_tree(config))
    changed = [key for key in now if key in before and before[key] != now[key]]
    for key in changed:
        if key.startswith(REFUSED):
            raise CheckpointError(
                key,
                now[key],
                f"step {step} in {uri} was trained with {key}={before[key]!r}, which this run cannot "
                f"change: resume with {key}={before[key]!r}, or start over in another checkpoint.uri",
            )
    return [f"{key} {before[key]!r} -> {now[key]!r}" for key in changed if key.startswith(REPORTED)]


def decided_by_rank0(context: DistContext, decide: Callable[[], T]) -> T:
    """`decide()` on rank 0, its value or its CheckpointError seen by every rank alike."""
    outcome: Any = None
    if context.is_main:
        try:
            outcome = decide()
        except CheckpointError as error:
            outcome = error
    outcome = broadcast_object(outcome)
    if isinstance(outcome, CheckpointError):
        raise outcome
    return outcome


def data_changes(
    saved: dict[str, Any] | None,
    now: DataIdentity,
    config: DataConfig,
    step: int,
    epoch: int,
    uri: str,
    mid_epoch: bool = True,
) -> list[str]:
    """What differs from the data `step` was trained on (`trainer.data.identity`), in
    epoch `epoch` (from 1; `mid_epoch`: part of it trained): empty for the same data; a
    CheckpointError under `data.on_change=refuse`, which names the ways on."""
    if saved is None:  # written before checkpoints recorded their data: nothing to compare
        return []
    differences = now.differences(DataIdentity.from_tree(saved))
    if differences and config.on_change == "refuse":
        key, value = ("data.path", config.path) if config.path else ("data.name", config.name)
        raise CheckpointError(
            key,
            value,
            f"step {step} in {uri} was trained on other data ({'; '.join(differences)}): restore "
            f"that data to resume exactly, set data.on_change=restart_epoch to keep the weights and "
            f"{f'train epoch {epoch} again from its start' if mid_epoch else f'go on from epoch {epoch}'} "
            f"on this data, or {new_run(uri)}",
        )
    return differences


def new_run(uri: str) -> str:
    """How to start a new run instead: another location; on a laptop's folder, also its removal."""
    local = "://" not in uri or uri.startswith("file://")
    return "set checkpoint.uri elsewhere to start a new run" + (f" (or remove {uri})" if local else "")
