"""A hung collective leaves evidence: each rank's flight recorder, dumped when the node's
watchdog is about to kill a rank, and kept beside the checkpoints.

torch keeps a rank's last N collectives (which, on which group, with what sizes, issued
from where, started or completed) where `TORCH_FR_BUFFER_SIZE` is set (gloo and the rest;
checked here on gloo) or `TORCH_NCCL_TRACE_BUFFER_SIZE` (NCCL; the chart sets it on GPU
pods). NCCL's own watchdog dumps them when a collective times out. A rank stuck anywhere
else (a peer that stopped, a data stall, a deadlock in Python) times out nothing before
this project's watchdog kills it, and its pod's files go with the pod. So before a kill the
watchdog asks every rank of its node (`request_dumps`); a thread of each rank answers, which
it can while the main thread waits in a collective (the wait releases the GIL), with the
recorder's dump (`torch._C._distributed_c10d._dump_fr_trace`, pickled), written to the
checkpoint store as `flight-recorder/<run id>/restart-<n>/rank-<r>`, where `ddp-ops
flight-recorder` finds it and runs torch's analyser over a restart's dumps.

Off unless a buffer size is set: the recorder captures each collective's Python stack,
which on a CPU step of a few milliseconds is not free (docs/failures.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the watchdog imports this module, and not torch
    from trainer.distributed.process_group import DistContext


class Store(Protocol):
    """Where the dumps go: the checkpoint store (`trainer.checkpoint.store`), by its `put`."""

    def put(self, name: str, data: bytes) -> None: ...


BUFFER_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
FOLDER = "flight-recorder"
POLL_S = 0.2
DUMP_WAIT_S = 3.0  # what the watchdog gives the ranks to answer before it kills


def recording() -> bool:
    """Whether this process's collectives are recorded (a buffer size above 0)."""
    return any(os.environ.get(name, "0").strip() not in ("", "0") for name in BUFFER_ENV)


def request_file(folder: Path, rank: int) -> Path:
    return folder / f"rank-{rank}.dump-request"


def answered_file(folder: Path, rank: int) -> Path:
    return folder / f"rank-{rank}.dumped"


def dump_name(run_id: str, restart: int, rank: int) -> str:
    """Where a rank's dump goes in the checkpoint store."""
    return f"{FOLDER}/{run_id}/restart-{restart}/rank-{rank}"


def request_dumps(folder: Path, ranks: list[int]) -> None:
    """The watchdog's ask: a request file per rank, beside its heartbeat record."""
    for rank in ranks:
        with contextlib.suppress(OSError):
            request_file(folder, rank).touch()


def answered(folder: Path, ranks: list[int]) -> bool:
    return all(answered_file(folder, rank).exists() for rank in ranks)


class DumpOnRequest:
    """This rank's answer to the watchdog: a daemon thread that looks for the request file
    every `POLL_S` and stores the dump once. A failed dump or upload is one warning."""

    def __init__(self, folder: Path, rank: int, store: Store, name: str, log: logging.Logger) -> None:
        self.folder, self.rank, self.store, self.name, self.log = folder, rank, store, name, log
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="flight-recorder-dump", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        request = request_file(self.folder, self.rank)
        while not self.stopped.wait(POLL_S):
            if request.exists():
                self._dump()
                return

    def _dump(self) -> None:
        import torch.distributed as dist
        from torch._C import _distributed_c10d as c10d

        try:  # NCCL's recorder is its own (`_dump_nccl_trace`, in CUDA builds only)
            nccl = (
                dist.is_initialized() and dist.get_backend() == "nccl" and hasattr(c10d, "_dump_nccl_trace")
            )
            data = c10d._dump_nccl_trace() if nccl else c10d._dump_fr_trace()
            self.store.put(self.name, data)
        except Exception as error:
            self.log.warning("flight recorder: rank %d's dump was not stored (%s)", self.rank, error)
        finally:
            with contextlib.suppress(OSError):
                answered_file(self.folder, self.rank).touch()

    def stop(self) -> None:
        self.stopped.set()


def start_dumps(
    folder: Path, context: DistContext, store: Store, log: logging.Logger
) -> DumpOnRequest | None:
    """The dump thread where collectives are recorded, else None."""
    if not recording():
        return None
    name = dump_name(context.run_id, context.restart_count, context.rank)
    return DumpOnRequest(folder, context.rank, store, name, log)
