"""Where this process stands in the job, read from what torchrun sets, and its process group.

torchrun (and through it the Kubeflow operator's PET_* variables) decides ranks; this module
only reads them. Without torchrun the same code runs as a world of one.
"""

from __future__ import annotations

import gc
import os
import socket
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    """This process's ranks and the run's identity."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    restart_count: int
    run_id: str
    hostname: str
    launched_by_torchrun: bool

    @property
    def is_main(self) -> bool:
        """Global rank 0 logs progress and writes checkpoints."""
        return self.rank == 0

    @property
    def is_node_main(self) -> bool:
        """Local rank 0 does per-node work (metrics server, downloads)."""
        return self.local_rank == 0


def read_env(env: Mapping[str, str] = os.environ) -> DistContext:
    """Read the variables torchrun sets for its workers; a plain `python` run is a world of one."""
    launched = "TORCHELASTIC_RUN_ID" in env or "LOCAL_RANK" in env

    def number(name: str, default: int) -> int:
        return int(env.get(name, default)) if launched else default

    world_size = number("WORLD_SIZE", 1)
    local_world_size = number("LOCAL_WORLD_SIZE", 1)
    return DistContext(
        rank=number("RANK", 0),
        local_rank=number("LOCAL_RANK", 0),
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=number("GROUP_RANK", 0),
        num_nodes=number("GROUP_WORLD_SIZE", max(1, world_size // max(1, local_world_size))),
        restart_count=number("TORCHELASTIC_RESTART_COUNT", 0),
        run_id=env.get("TORCHELASTIC_RUN_ID", "local") if launched else "local",
        hostname=socket.gethostname(),
        launched_by_torchrun=launched,
    )


def cuda_available() -> bool:
    """Whether a CUDA device can be used (kept in one place so checks agree)."""
    return torch.cuda.is_available()


def select_device(requested: str, context: DistContext) -> torch.device:
    """`auto` picks CUDA when present; on CUDA every process binds `cuda:LOCAL_RANK`."""
    use_cuda = requested == "cuda" or (requested == "auto" and cuda_available())
    if not use_cuda:
        return torch.device("cpu")
    device = torch.device("cuda", context.local_rank)
    torch.cuda.set_device(device)
    return device


@contextmanager
def process_group(context: DistContext, device: torch.device, timeout_s: float) -> Iterator[None]:
    """nccl on CUDA, gloo on CPU; a one-process group in memory when torchrun is absent.
    Every collective gives up after `timeout_s` rather than torch's 10 or 30 minutes."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if context.launched_by_torchrun:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    yield
    # Only on success: tearing down while a failed peer is mid-collective can hang. DDP's
    # reference cycles hold the group; freeing them first lets its threads be joined now
    # rather than during interpreter shutdown (seen as a rare SIGABRT at exit). The barrier
    # keeps one rank from closing connections that another still reads from.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


# what gloo and NCCL say when a collective's peer process is gone (a killed pod, a lost node)
PEER_LOST_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote worker",
    "NCCL communicator was aborted",
)


def peer_lost(error: BaseException) -> str | None:
    """The one-line reason when `error` is a collective failing because another rank went
    away, else None. torchrun then restarts the workers; a traceback would say nothing more."""
    text = str(error).strip()
    if not (isinstance(error, dist.DistError) or any(marker in text for marker in PEER_LOST_MARKERS)):
        return None
    first_line = text.splitlines()[0] if text else type(error).__name__
    if first_line.startswith("["):  # gloo's source file and line
        first_line = first_line.split("] ", 1)[-1]
    return first_line.split(". ")[0].rstrip(".")  # the first sentence: what happened, not advice


def wait_for_peers(work: dist.Work) -> None:
    """Wait for an asynchronous collective. Named so, a rank blocked here reads as waiting
    for its peers in a stack dump (`trainer.distributed.watchdog`), not as the hung one."""
    work.wait()


def broadcast_flag(value: bool, device: torch.device) -> bool:
    """Rank 0's decision, seen identically by every rank."""
    flag = torch.tensor([1 if value else 0], device=device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def broadcast_object(value: object) -> object:
    """Rank 0's picklable value (a step, or an error to raise everywhere), seen by every rank."""
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]
