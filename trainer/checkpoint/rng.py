"""Every random generator a rank uses, as data that `torch.load(weights_only=True)` accepts."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture() -> dict[str, Any]:
    """This process's RNG states (numpy's key as a list, so no pickled arrays are needed)."""
    numpy_state = np.random.get_state(legacy=False)
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": {
            "bit_generator": numpy_state["bit_generator"],
            "key": numpy_state["state"]["key"].tolist(),
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        },
    }


def restore(state: dict[str, Any]) -> None:
    """Put back what `capture` saved."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
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
