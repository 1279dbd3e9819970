"""Custom runtimes: a user's class wrapping the engine (`framework: custom`, `runtime: module:Class`).

A runtime gets the model's path and engine options when it starts, and may add inputs and
outputs by overriding the per-row hooks; batching is unchanged because the worker still
hands it one row at a time per engine request. Subclass `CustomRuntime`:

    class MyRuntime(CustomRuntime):
        def prompt_for(self, row):                         # row: the input row, as a dict
            return f"{row['system_prompt']}\\n\\n{row['prompt']}"

        def extra_outputs(self, row, text, num_output_tokens):
            return {"words": len(text.split())}           # more output fields

The class must be importable where the worker runs.
"""

from __future__ import annotations

import importlib
from collections.abc import AsyncGenerator
from typing import Any

from sluice.config.engine import VLLMConfig
from sluice.config.model import ConfigError, ModelConfig
from sluice.workers.engines.base import Engine, GenerationRequest, TokenDelta
from sluice.workers.engines.prefix_cache import PrefixCacheCounters


class CustomRuntime(Engine):
    """Wraps an inner engine (vLLM by default); override `create_engine` to build another."""

    def __init__(self, model: ModelConfig, model_path: str, options: VLLMConfig):
        self.model = model
        self.model_path = model_path
        self.options = options
        self.engine: Engine | None = None

    def create_engine(self) -> Engine:
        from sluice.workers.engines.vllm import VLLMEngine

        return VLLMEngine(self.model_path, self.options)

    async def start(self) -> None:
        self.engine = self.create_engine()
        await self.engine.start()

    def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenDelta, None]:
        assert self.engine is not None, "start() first"
        return self.engine.generate(request)

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        assert self.engine is not None, "start() first"
        return self.engine.render_chat(messages, tools)

    def tool_calls(self, row: dict[str, Any], text: str) -> tuple[list[dict[str, Any]], str | None] | None:
        assert self.engine is not None, "start() first"
        return self.engine.tool_calls(row, text)

    def prefix_cache_counters(self) -> PrefixCacheCounters | None:
        return self.engine.prefix_cache_counters() if self.engine is not None else None

    async def abort(self, request_id: str) -> None:
        if self.engine is not None:
            await self.engine.abort(request_id)

    async def shutdown(self) -> None:
        if self.engine is not None:
            await self.engine.shutdown()


def load_runtime_class(spec: str) -> type[CustomRuntime]:
    module_name, _, class_name = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"runtime: cannot load {spec!r}: {err}") from None
    if not (isinstance(cls, type) and issubclass(cls, CustomRuntime)):
        raise ConfigError(f"runtime: {spec!r} is not a subclass of "
                          "sluice.workers.engines.custom.CustomRuntime")
    return cls
