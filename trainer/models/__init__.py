"""Models behind one registry; a user's own plugs in as `package.module:function`."""

from torch import nn

from trainer.config import ConfigError, ModelConfig
from trainer.config.registry import MODELS
from trainer.data.base import DataSpec

__all__ = ["MODELS", "build_model"]


def build_model(config: ModelConfig, spec: DataSpec) -> nn.Module:
    """The configured model; plug-ins are `package.module:function(model_config, data_spec)`."""
    model = MODELS.build(config.name, config, spec)
    if not isinstance(model, nn.Module):
        raise ConfigError("model.name", config.name, "a model builder must return a torch.nn.Module")
    return model
