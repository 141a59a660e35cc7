"""Kiln configuration: the typed schema (`configs.schema`), YAML presets beside it, and the loader."""

from configs.loader import ConfigError, load_config, to_dict, to_yaml
from configs.schema import (
    AlgoConfig,
    ClusterConfig,
    EvalConfig,
    KilnConfig,
    LearnerConfig,
    LoggingConfig,
    ModelConfig,
    ModelledLatencyConfig,
    ReplayConfig,
    RolloutConfig,
    SGLangConfig,
    VerifierConfig,
    WarmStartConfig,
    WeightSyncConfig,
)

__all__ = [
    "AlgoConfig",
    "ClusterConfig",
    "ConfigError",
    "EvalConfig",
    "KilnConfig",
    "LearnerConfig",
    "LoggingConfig",
    "ModelConfig",
    "ModelledLatencyConfig",
    "ReplayConfig",
    "RolloutConfig",
    "SGLangConfig",
    "VerifierConfig",
    "WarmStartConfig",
    "WeightSyncConfig",
    "load_config",
    "to_dict",
    "to_yaml",
]
