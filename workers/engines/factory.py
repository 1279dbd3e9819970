"""Build the engine a deployment names."""

from __future__ import annotations

from typing import Literal

from sluice.config.model import ModelConfig
from sluice.config.settings import Settings
from sluice.workers.engines.base import Engine
from sluice.workers.engines.null import NullEngine

EngineKind = Literal["vllm", "null"]


def build_engine(model: ModelConfig, settings: Settings, kind: EngineKind = "vllm") -> Engine:
    if kind == "null":
        return NullEngine(delay_s=settings.null_delay_s, token_delay_s=settings.null_token_delay_s,
                          crash_on=settings.null_crash_on,
                          composition=settings.null_composition)
    from sluice.workers.model_prep import resolve_model_path

    path = resolve_model_path(model.path, settings.cache_dir)
    if model.framework == "custom":
        from sluice.workers.engines.custom import load_runtime_class

        assert model.runtime is not None  # checked when the deployment was loaded
        return load_runtime_class(model.runtime)(model, path, model.framework_config)
    from sluice.workers.engines.vllm import VLLMEngine

    return VLLMEngine(path, model.framework_config)
