"""Engine adapters: vLLM, a null engine for measuring the queue alone, custom runtimes."""

from sluice.workers.engines.base import Engine, GenerationRequest, TokenDelta

__all__ = ["Engine", "GenerationRequest", "TokenDelta"]
