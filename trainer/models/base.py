"""The checks that a model fits the data it is given."""

from __future__ import annotations

from trainer.config import ConfigError
from trainer.data.base import DataSpec, Task


def require(spec: DataSpec, model: str, task: Task, input_rank: int | None = None) -> None:
    """Refuse data of the wrong kind with a config error rather than a shape error later."""
    if spec.task != task or (input_rank is not None and len(spec.input_shape) != input_rank):
        wanted = f"{task} data" + (f" with {input_rank}-d inputs" if input_rank else "")
        raise ConfigError(
            "model.name", model, f"needs {wanted}; the dataset gives {spec.task} of {spec.input_shape}"
        )
