"""Configuration: settings from SLUICE_* variables, model deployments, engine and batching options."""

from sluice.config.batching import (
    CONTINUOUS_MULTI_ROW,
    CONTINUOUS_WITH_SINGLE,
    DYNAMIC_WITH_SINGLE,
    MAX_BATCH_SIZE_EXCEEDED,
    SINGLE_MULTI_ROW,
    ContinuousBatchingConfig,
    DynamicBatchingConfig,
)
from sluice.config.engine import VLLMConfig
from sluice.config.model import BatchMode, ModelConfig, load_models
from sluice.config.schema import DEFAULT_INPUT_SCHEMA, DEFAULT_OUTPUT_SCHEMA, ArrowField
from sluice.config.settings import Settings

__all__ = [
    "ArrowField",
    "BatchMode",
    "CONTINUOUS_MULTI_ROW",
    "CONTINUOUS_WITH_SINGLE",
    "ContinuousBatchingConfig",
    "DEFAULT_INPUT_SCHEMA",
    "DEFAULT_OUTPUT_SCHEMA",
    "DYNAMIC_WITH_SINGLE",
    "DynamicBatchingConfig",
    "MAX_BATCH_SIZE_EXCEEDED",
    "ModelConfig",
    "SINGLE_MULTI_ROW",
    "Settings",
    "VLLMConfig",
    "load_models",
]
