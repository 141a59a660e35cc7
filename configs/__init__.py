"""Kiln configuration: the typed schema (`configs.schema`, with the rollout, verifier and serve sections
in `configs.rollout`, `configs.verifier` and `configs.serve`), YAML presets beside it, and the loader."""

from configs.loader import ConfigError, load_config, to_dict, to_yaml
from configs.rollout import RolloutConfig, SGLangConfig
from configs.schema import (
    AlgoConfig,
    ClusterConfig,
    EvalConfig,
    KilnConfig,
    LearnerConfig,
    LoggingConfig,
    ModelConfig,
    ReplayConfig,
    WarmStartConfig,
    WeightSyncConfig,
)
from configs.serve import ServeConfig
from configs.verifier import ModelledLatencyConfig, VerifierConfig

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
    "ServeConfig",
    "VerifierConfig",
    "WarmStartConfig",
    "WeightSyncConfig",
    "load_config",
    "to_dict",
    "to_yaml",
]
