"""A training state handed to the writer process through one shared-memory file.

The training process lays the state's tensors out once in a file under `/dev/shm` and, at
each save, copies them into it (the only pause the loop sees); the writer process maps the
same file and reads them in place. What is not a tensor (progress, config, step counters)
travels in the message as plain pickle. A new layout (the optimizer's state appears after
the first step) gets a new file. Each tensor is its own storage on the reading side, so
`torch.save` writes each once, with no bytes of its neighbours.
"""

from __future__ import annotations

import os
import pickle
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.process_identity import process_start, still_running

ALIGN = 64  # every tensor starts on a cache line, so that any dtype can view its bytes
PREFIX = "ddp-trainer-state-"  # then the training process's id and start, and a random tag


def shared_memory_dir() -> Path:
    """Where host buffers are shared: /dev/shm on Linux, the temp dir where it is absent."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    import tempfile

    return Path(tempfile.gettempdir())


@dataclass(frozen=True)
class TensorSlot:
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class SharedState:
    """What the writer process needs to rebuild a staged state: the file, where each tensor
    lies in it, and the pickled rest of the tree with `_Ref(index)` in the tensors' places."""

    path: str
    size: int
    slots: tuple[TensorSlot, ...]
    skeleton: bytes


@dataclass(frozen=True)
class _Ref:
    index: int


_ATOMS = (int, float, str, bool, type(None))


def split_tensors(value: Any, tensors: list[torch.Tensor]) -> Any:
    """`value` with each tensor appended to `tensors` and replaced by its index there."""
    if type(value) in _ATOMS:  # most leaves: answered before any isinstance walk
        return value
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach())
        return _Ref(len(tensors) - 1)
    if isinstance(value, dict):
        return {key: split_tensors(item, tensors) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(split_tensors(item, tensors) for item in value)
    return value


def join_tensors(value: Any, tensors: list[torch.Tensor]) -> Any:
    """What `split_tensors` took apart, with `tensors` put back in their places."""
    if isinstance(value, _Ref):
        return tensors[value.index]
    if isinstance(value, dict):
        return {key: join_tensors(item, tensors) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(join_tensors(item, tensors) for item in value)
    return value


class SharedStateBuffer:
    """The training process's side: copies a state into the shared file at each save."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = folder or shared_memory_dir()
        self.path: Path | None = None
        self._layout: tuple[tuple[torch.dtype, tuple[int, ...]], ...] | None = None
        self._slots: tuple[TensorSlot, ...] = ()
        self._views: list[torch.Tensor] = []
        self._size = 0

    def fill(self, state: dict[str, Any]) -> SharedState:
        """Copy every tensor of `state` into the shared file (laid out anew if its shapes
        changed). Raises OSError when the file cannot get its space."""
        tensors: list[torch.Tensor] = []
        skeleton = pickle.dumps(split_tensors(state, tensors), protocol=pickle.HIGHEST_PROTOCOL)
        layout = tuple((t.dtype, tuple(t.shape)) for t in tensors)
        if layout != self._layout:
            self._allocate(layout)
        torch._foreach_copy_(self._views, [tensor.reshape(-1) for tensor in tensors])
        return SharedState(str(self.path), self._size, self._slots, skeleton)

    def rehome(self, shared: SharedState) -> SharedState:
        """The last state filled, in a new file: a writer maps the file and removes its name,
        so the writer that replaces a stuck one could not open the old one. This process
        still maps the old file's bytes, and copies them over."""
        old_views, layout = self._views, self._layout
        self._allocate(layout)
        torch._foreach_copy_(self._views, old_views)
        return SharedState(str(self.path), self._size, self._slots, shared.skeleton)

    def _allocate(self, layout: tuple[tuple[torch.dtype, tuple[int, ...]], ...]) -> None:
        self.close()
        remove_orphans(self.folder)
        slots, end = aligned_slots(layout)
        size = max(end, ALIGN)
        owner = os.getpid()
        path = self.folder / f"{PREFIX}{owner}-{process_start(owner)}-{uuid.uuid4().hex[:8]}"
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # reserve every page now: a tmpfs that runs out later kills with SIGBUS instead
            os.posix_fallocate(descriptor, 0, size)
        except OSError:
            path.unlink()
            raise
        finally:
            os.close(descriptor)
        self.path, self._layout, self._slots, self._size = path, layout, slots, size
        self._views = [view.reshape(-1) for view in map_slots(str(path), size, self._slots)]

    def close(self) -> None:
        """Remove the file; a reader that mapped it keeps its mapping until it lets go."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)
        self.path, self._layout, self._views = None, None, []


Layout = Sequence[tuple[torch.dtype, tuple[int, ...]]]


def aligned_slots(layout: Layout) -> tuple[tuple[TensorSlot, ...], int]:
    """Where each tensor of `layout` lies in one flat byte buffer, each on an ALIGN boundary,
    and the buffer's length."""
    slots, offset = [], 0
    for dtype, shape in layout:
        nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        slots.append(TensorSlot(offset, nbytes, str(dtype).removeprefix("torch."), shape))
        offset += -(-nbytes // ALIGN) * ALIGN
    return tuple(slots), offset


def remove_orphans(folder: Path) -> None:
    """Buffers whose training process is gone and whose writer never mapped them (both
    killed at once): their names hold the dead process's id and start, so that a process
    that got its pid since does not keep them (a run's whole state, in memory)."""
    for path in folder.glob(f"{PREFIX}*"):
        owner = path.name.removeprefix(PREFIX).split("-")
        if len(owner) != 3 or not (owner[0].isdigit() and owner[1].isdigit()):
            continue  # not one of ours
        if not still_running(int(owner[0]), int(owner[1])):
            path.unlink(missing_ok=True)


def map_slots(path: str, size: int, slots: tuple[TensorSlot, ...]) -> list[torch.Tensor]:
    """Each slot of the shared file as a tensor over its own bytes (shared, not copied). An
    empty tensor gets no bytes at all: a view at its offset would start where the next
    tensor does, and `torch.save` refuses two tensors of different dtypes at one address
    (PowerSGD's error feedback is empty until it starts, beside int64 generator keys)."""
    whole = np.memmap(path, dtype=np.uint8, mode="r+", shape=(size,))
    return [_slot_tensor(whole, slot) for slot in slots]


def _slot_tensor(whole: np.ndarray, slot: TensorSlot) -> torch.Tensor:
    dtype = getattr(torch, slot.dtype)
    if slot.nbytes == 0:
        return torch.empty(slot.shape, dtype=dtype)
    return torch.from_numpy(whole[slot.offset : slot.offset + slot.nbytes]).view(dtype).view(slot.shape)


class SharedStateReader:
    """The writer process's side: the state a message describes, read from the shared file."""

    def __init__(self) -> None:
        self._mapped: tuple[str, list[torch.Tensor]] | None = None

    def open(self, shared: SharedState) -> dict[str, Any]:
        if self._mapped is None or self._mapped[0] != shared.path:
            self._mapped = (shared.path, map_slots(shared.path, shared.size, shared.slots))
            # both sides have it mapped now: without a name, its memory goes with the last
            # mapping, so a killed training process leaves nothing behind in /dev/shm
            Path(shared.path).unlink(missing_ok=True)
        return join_tensors(pickle.loads(shared.skeleton), self._mapped[1])
