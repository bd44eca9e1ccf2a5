"""The job's node-count bounds, as torchrun's `--nnodes` (MIN or MIN:MAX) sets them.

torchrun does not pass them on to its workers, yet a node that finds a peer lost must know
whether the survivors may train without it. `ddp-launch` exports them from its torchrun
arguments (`TRAINER_NNODES`); under the operators, the pod's own `PET_NNODES`, which the
workers inherit, says the same (operator_scripts/controllers: pytorchjob_env.py,
trainjob_env.py). Torch-free: the launcher reads it too.
"""

from __future__ import annotations

from collections.abc import Mapping

NNODES_ENV, PET_NNODES_ENV = "TRAINER_NNODES", "PET_NNODES"


def node_bounds(env: Mapping[str, str]) -> tuple[int, int] | None:
    """(min, max) nodes, where they are known and well-formed."""
    spec = env.get(NNODES_ENV) or env.get(PET_NNODES_ENV)
    if not spec:
        return None
    low, _, high = spec.partition(":")
    try:
        return int(low), int(high or low)
    except ValueError:
        return None


def describe(bounds: tuple[int, int]) -> str:
    """`--nnodes=2` or `--nnodes=1:2`, as the user wrote it."""
    low, high = bounds
    return f"--nnodes={low}" if low == high else f"--nnodes={low}:{high}"
