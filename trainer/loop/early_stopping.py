"""Early stopping on a validation metric, with state that survives a resume."""

from __future__ import annotations

import math
from typing import Any

from trainer.config import EarlyStoppingConfig


class EarlyStopping:
    """Counts epochs without an improvement of at least `min_delta`; patience 0 never stops."""

    def __init__(self, config: EarlyStoppingConfig) -> None:
        self.config = config
        self.maximize = config.metric == "val_accuracy"
        self.best = -math.inf if self.maximize else math.inf
        self.bad_epochs = 0

    def update(self, metrics: dict[str, float]) -> bool:
        """Record one validation; True when training should stop."""
        value = metrics[self.config.metric.removeprefix("val_")]
        gain = value - self.best if self.maximize else self.best - value
        if gain > self.config.min_delta:
            self.best, self.bad_epochs = value, 0
        else:
            self.bad_epochs += 1
        return 0 < self.config.patience <= self.bad_epochs

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad_epochs": self.bad_epochs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.bad_epochs = float(state["best"]), int(state["bad_epochs"])
