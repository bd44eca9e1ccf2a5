"""Every random generator a rank uses, packed into one fixed-size byte tensor.

Fixed size, so that every rank's streams are gathered with one `all_gather_into_tensor`
(no pickling, ~10 KB a rank) and saved as one `[world_size, N]` tensor, which
`torch.load(weights_only=True)` accepts. The layout, little-endian:

    header   uint32 x 3   format, CPU state length, whether the CUDA part is set
    torch    uint8 x 5056 the CPU generator (MT19937)
    cuda     uint8 x 16   the current CUDA device's generator (seed and offset), or zeros
    python   uint32 x 626 random's version and its 625 state words; uint8 + float64 gauss
    numpy    uint32 x 624 MT19937 key; int32 pos, has_gauss; float64 gauss

Only the current CUDA device's stream is saved and restored: a process drives one GPU, and
a resume on a host with another GPU count must not index devices it does not have.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

FORMAT = 1
CPU_BYTES, CUDA_BYTES, MT_WORDS = 5056, 16, 624
_FIELDS = [
    ("header", np.uint32, 3),
    ("torch", np.uint8, CPU_BYTES),
    ("cuda", np.uint8, CUDA_BYTES),
    ("python", np.uint32, MT_WORDS + 2),
    ("python_has_gauss", np.uint8, 1),
    ("python_gauss", np.float64, 1),
    ("numpy_key", np.uint32, MT_WORDS),
    ("numpy_counters", np.int32, 2),
    ("numpy_gauss", np.float64, 1),
]
_LAYOUT = np.dtype([(name, kind, (count,)) for name, kind, count in _FIELDS])
PACKED_BYTES = _LAYOUT.itemsize


def pack() -> torch.Tensor:
    """This process's RNG states as `PACKED_BYTES` uint8s."""
    record = np.zeros((), dtype=_LAYOUT)
    cpu = torch.get_rng_state().numpy()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    record["header"] = (FORMAT, cpu.size, int(cuda))
    record["torch"] = cpu
    if cuda:
        record["cuda"] = torch.cuda.get_rng_state().numpy()
    version, internal, gauss = random.getstate()
    record["python"] = (version, *internal)
    record["python_has_gauss"] = gauss is not None
    record["python_gauss"] = gauss or 0.0
    numpy_state = np.random.get_state(legacy=False)
    if numpy_state["bit_generator"] != "MT19937":
        raise ValueError(f"numpy's global generator is {numpy_state['bit_generator']}, not MT19937")
    record["numpy_key"] = numpy_state["state"]["key"]
    record["numpy_counters"] = (numpy_state["state"]["pos"], numpy_state["has_gauss"])
    record["numpy_gauss"] = numpy_state["gauss"]
    return torch.from_numpy(np.frombuffer(record.tobytes(), dtype=np.uint8).copy())


def restore(state: torch.Tensor | dict[str, Any]) -> None:
    """Put back what `pack` saved (or the dict form of checkpoints saved before it)."""
    if isinstance(state, dict):
        _restore_dict(state)
        return
    record = np.frombuffer(state.numpy().tobytes(), dtype=_LAYOUT)[0]
    form, cpu_bytes, cuda = (int(value) for value in record["header"])
    if form != FORMAT or cpu_bytes != CPU_BYTES:
        raise ValueError(f"RNG state of format {form} ({cpu_bytes} CPU bytes); this trainer reads {FORMAT}")
    torch.set_rng_state(torch.from_numpy(record["torch"].copy()))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.from_numpy(record["cuda"].copy()))
    words = record["python"].tolist()
    gauss = float(record["python_gauss"][0]) if record["python_has_gauss"][0] else None
    random.setstate((words[0], tuple(words[1:]), gauss))
    pos, has_gauss = (int(value) for value in record["numpy_counters"])
    np.random.set_state(
        {
            "bit_generator": "MT19937",
            "state": {"key": record["numpy_key"].copy(), "pos": pos},
            "has_gauss": has_gauss,
            "gauss": float(record["numpy_gauss"][0]),
        }
    )


def _restore_dict(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available() and torch.cuda.current_device() < len(state["cuda"]):
        torch.cuda.set_rng_state(state["cuda"][torch.cuda.current_device()])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": numpy_state["bit_generator"],
            "state": {"key": np.array(numpy_state["key"], dtype=np.uint32), "pos": numpy_state["pos"]},
            "has_gauss": numpy_state["has_gauss"],
            "gauss": numpy_state["gauss"],
        }
    )


def seed_everything(seed: int) -> None:
    """One seed for torch, python and numpy."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
