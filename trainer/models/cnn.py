"""`cnn`: a small convolutional classifier for digits, MNIST and synthetic images."""

from __future__ import annotations

from torch import nn

from trainer.config import ModelConfig
from trainer.data.base import DataSpec
from trainer.models.base import require


def build_cnn(config: ModelConfig, spec: DataSpec) -> nn.Module:
    """`depth` conv blocks doubling from `width` channels, pooling while the map is >= 4 px."""
    require(spec, "cnn", "classification", input_rank=3)
    channels, height, width = spec.input_shape
    layers: list[nn.Module] = []
    for block in range(config.depth):
        out_channels = config.width * 2**block
        layers += [nn.Conv2d(channels, out_channels, 3, padding=1), nn.ReLU()]
        if min(height, width) >= 4:
            layers.append(nn.MaxPool2d(2))
            height, width = height // 2, width // 2
        channels = out_channels
    hidden = 4 * config.width
    layers += [
        nn.Flatten(),
        nn.Dropout(config.dropout),
        nn.Linear(channels * height * width, hidden),
        nn.ReLU(),
        nn.Linear(hidden, spec.num_classes),
    ]
    return nn.Sequential(*layers)
