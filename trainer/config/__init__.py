"""Configuration and the command line: the typed config tree (`schema`), Helm-style `--set`
overrides, one-line argument errors, and the registry that resolves names and plug-ins.

The config tree is the public face of this package (plug-ins receive its sections), so its
names are importable from `trainer.config` itself."""

from trainer.config.loading import bundled_config_names, dump_yaml, from_tree, load_config, to_tree
from trainer.config.schema import (
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    DdpConfig,
    DistConfig,
    EarlyStoppingConfig,
    LogConfig,
    MetricsConfig,
    ModelConfig,
    OptimConfig,
    ShardsConfig,
    SyntheticConfig,
    TrainConfig,
    WatchdogConfig,
    did_you_mean,
)

__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DdpConfig",
    "DistConfig",
    "EarlyStoppingConfig",
    "LogConfig",
    "MetricsConfig",
    "ModelConfig",
    "OptimConfig",
    "ShardsConfig",
    "SyntheticConfig",
    "TrainConfig",
    "WatchdogConfig",
    "bundled_config_names",
    "did_you_mean",
    "dump_yaml",
    "from_tree",
    "load_config",
    "to_tree",
]
