"""`mlp`: a fully connected classifier on flattened inputs of any shape."""

from __future__ import annotations

import math

from torch import nn

from trainer.config import ModelConfig
from trainer.data.base import DataSpec
from trainer.models.base import require


def build_mlp(config: ModelConfig, spec: DataSpec) -> nn.Module:
    """`depth` hidden layers of `width` units with ReLU and dropout."""
    require(spec, "mlp", "classification")
    layers: list[nn.Module] = [nn.Flatten()]
    features = math.prod(spec.input_shape)
    for _ in range(config.depth):
        layers += [nn.Linear(features, config.width), nn.ReLU(), nn.Dropout(config.dropout)]
        features = config.width
    layers.append(nn.Linear(features, spec.num_classes))
    return nn.Sequential(*layers)
