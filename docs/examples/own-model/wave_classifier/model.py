"""`model.name=wave_classifier.model:build_model`: a 1-D convolutional classifier.

A model plug-in is `builder(config: ModelConfig, spec: DataSpec) -> torch.nn.Module`; it
sizes itself from the data's `spec` and reads `model.width`, `model.depth` and
`model.dropout` (its own settings would go in `model.options`).
"""

from __future__ import annotations

from torch import nn

from trainer.config import ModelConfig
from trainer.data.base import DataSpec


def build_model(config: ModelConfig, spec: DataSpec) -> nn.Module:
    channels, layers = spec.input_shape[0], []
    for _ in range(config.depth):
        layers += [nn.Conv1d(channels, config.width, kernel_size=5, padding=2), nn.ReLU()]
        channels = config.width
    return nn.Sequential(
        *layers,
        nn.AdaptiveAvgPool1d(1),
        nn.Flatten(),
        nn.Dropout(config.dropout),
        nn.Linear(channels, spec.num_classes),
    )
