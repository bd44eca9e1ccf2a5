"""The figures of a progress line as Kubeflow Trainer's TrainJob status holds them
(`status.trainerStatus`, trainjob_types.go:565-607): what rank 0 posts to the status server,
and what `ddp-ops status` shows for either kind of job. No torch here: ddp-ops imports it."""

from __future__ import annotations

import math
from datetime import datetime

INT32_MAX = 2**31 - 1
# the metrics a status carries, each as the status shows it (a string of 1 to 64 characters)
SHOWN = {
    "loss": "{:.6g}",
    "samples_per_second": "{:.1f}",
    "step": "{:.0f}",
    "total_steps": "{:.0f}",
    "durable_step": "{:.0f}",
    "val_loss": "{:.6g}",
}


def trainer_status(figures: dict[str, float], now: datetime) -> dict:
    """The body the server takes (`UpdateTrainJobStatusRequest`) for rank 0's newest figures:
    `step`, `total_steps`, `eta_seconds`, `loss`, `samples_per_second`, and where known the
    newest durable step and the validation loss. Progress is rounded down, so 100 means
    every step is done."""
    status: dict = {"lastUpdatedTime": now.strftime("%Y-%m-%dT%H:%M:%SZ")}
    step, total = figures.get("step"), figures.get("total_steps")
    if step is not None and total:
        status["progressPercentage"] = max(0, min(100, math.floor(100 * step / total)))
    if (eta := figures.get("eta_seconds")) is not None:
        status["estimatedRemainingSeconds"] = max(0, min(INT32_MAX, round(eta)))
    metrics = [
        {"name": name, "value": form.format(figures[name])}
        for name, form in SHOWN.items()
        if figures.get(name) is not None and math.isfinite(figures[name])
    ]
    if metrics:
        status["metrics"] = metrics
    return {"trainerStatus": status}
