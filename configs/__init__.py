"""Kiln configuration: the typed schema (`configs.schema`, with the rollout and verifier sections in
`configs.rollout` and `configs.verifier`), YAML presets beside it, and the loader."""

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
    "VerifierConfig",
    "WarmStartConfig",
    "WeightSyncConfig",
    "load_config",
    "to_dict",
    "to_yaml",
]
