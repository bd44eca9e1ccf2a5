"""`snapshots.stateSize` from the model, where `ddp-ops` renders.

A pod's /dev/shm holds three training states when snapshots are on (two snapshots and the
writer's host copy) and is memory: it counts against the pod's limit. The chart's fixed
default (1Gi: a model of up to about 85M parameters with AdamW) wastes a GPU pod's memory on
a small model and lets a large one fill /dev/shm until the kubelet evicts the pod. So where
`ddp-ops` renders and the values leave `snapshots.stateSize` unset, it is the size the
trainer will save: the model built on the meta device (no weights allocated), its weights,
buffers and optimizer state, as `TrainingState.size_bytes` counts them. That needs the data's
shape from the config alone: a built-in model on `digits` or `synthetic` data. For a
plug-in (whose code `ddp-ops` does not run) or data read from files or S3, the values' own
stateSize stands, and helm/README.md says what its default fits.
"""

from __future__ import annotations

import math
from typing import Any

from trainer.config import Config
from trainer.config.registry import MODELS


def derived_state_size(config: Config, values: dict[str, Any]) -> str | None:
    """The state's size in whole MiB, as the chart takes it, or None where it cannot be
    known here."""
    if MODELS.is_plugin(config.model.name) or config.data.name not in ("digits", "synthetic"):
        return None
    import torch  # what render needs only here

    from trainer.data.digits import DIGITS_SPEC
    from trainer.data.synthetic import synthetic_spec
    from trainer.loop.training_state import state_size_bytes
    from trainer.models import build_model

    spec = DIGITS_SPEC if config.data.name == "digits" else synthetic_spec(config.data.synthetic)
    with torch.device("meta"):
        module = build_model(config.model, spec)
    world_size = world_size_of(values)
    size = state_size_bytes(module, config.optim, world_size, powersgd=config.ddp.comm_hook == "powersgd")
    return f"{math.ceil(size / 2**20)}Mi"


def world_size_of(values: dict[str, Any]) -> int:
    """Ranks in the job, as the chart's topology counts them (PowerSGD keeps every rank's
    error feedback): the GPUs, or CPU pods times processes."""
    gpus = int(values["gpus"])
    return gpus if gpus > 0 else int(values["cpuNodes"]) * int(values["cpuProcsPerNode"])
