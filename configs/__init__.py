"""Kiln configuration: the typed schema (`configs.schema`), YAML presets beside it, and the loader."""

from configs.loader import ConfigError, load_config, to_dict, to_yaml
from configs.schema import (
    AlgoConfig,
    ClusterConfig,
    KilnConfig,
    LearnerConfig,
    LoggingConfig,
    ModelConfig,
    ReplayConfig,
    RolloutConfig,
    VerifierConfig,
)

__all__ = [
    "AlgoConfig", "ClusterConfig", "ConfigError", "KilnConfig", "LearnerConfig", "LoggingConfig",
    "ModelConfig", "ReplayConfig", "RolloutConfig", "VerifierConfig", "load_config", "to_dict", "to_yaml",
]
