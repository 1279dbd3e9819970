"""What the worker needs from an engine: start, stream one generation, abort it, shut down."""

from __future__ import annotations

import abc
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from sluice.protocol.messages import Sampled, SamplingExtras, StructuredSpec, TokenLogprob
from sluice.workers.engines.prefix_cache import PrefixCacheCounters


@dataclass
class GenerationRequest:
    request_id: str  # unique per engine request (a multi-row request has one per row)
    prompt: str
    max_tokens: int
    seed: int | None = None  # the row's
    # temperature, top_p, stop, penalties and vLLM's sampling extras, as their one declaration
    # has them (each a SamplingParams keyword of the same name): an engine passes them on as one.
    sampling: Sampled = field(default_factory=Sampled)
    logprobs: int | None = None  # per output token, with this many alternatives
    prompt_logprobs: int | None = None
    structured: StructuredSpec | None = None  # constrained decoding
    priority: int = 0  # lower first, where the engine schedules by priority
    # Tokens a previous attempt already delivered: generation continues after them (they
    # follow the prompt), and max_tokens counts only what is still to come.
    resume_token_ids: list[int] = field(default_factory=list)

    # A custom runtime (docs/operations.md) may read these by name, as before `sampling` held them.
    @property
    def temperature(self) -> float:
        return self.sampling.temperature

    @property
    def top_p(self) -> float:
        return self.sampling.top_p

    @property
    def stop(self) -> list[str]:
        return list(self.sampling.stop or [])

    @property
    def extras(self) -> SamplingExtras:
        return SamplingExtras.model_validate(self.sampling.extras())


@dataclass
class TokenDelta:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # set on the last delta: "stop", "length", "abort"
    prompt_tokens: int | None = None  # set on the first delta
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked for
    prompt_logprobs: list[TokenLogprob] | None = None  # on the first delta, when asked for


class Engine(abc.ABC):
    """An engine, or a custom runtime wrapping one (see workers/engines/custom.py).

    `prompt_for` and `extra_outputs` are the per-row hooks: how an input row becomes a
    prompt, and which output fields besides generated_text and num_output_tokens a
    finished row gets.
    """

    @abc.abstractmethod
    async def start(self) -> None: ...

    def prompt_for(self, row: dict[str, Any]) -> str:
        """The row's prompt; a chat row (`messages`) is rendered with the model's chat template."""
        if "messages" in row and not row.get("prompt"):
            return self.render_chat(row["messages"], row.get("tools"))
        return row["prompt"]

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """Engines without a tokenizer join the contents (the null engine)."""
        return "\n".join(str(m.get("content", "")) for m in messages)

    def extra_outputs(self, row: dict[str, Any], text: str, num_output_tokens: int) -> dict[str, Any]:
        return {}

    def tool_calls(self, row: dict[str, Any], text: str) -> tuple[list[dict[str, Any]], str | None] | None:
        """The tool calls in a chat row's output (with `tool_choice: "auto"`, the row names the
        deployment's tool-call parser), and the content beside them. Engines without a
        tokenizer find none."""
        return None

    def prefix_cache_counters(self) -> PrefixCacheCounters | None:
        """The engine's prefix-cache counters so far (tokens queried and found cached, as vLLM
        counts them), or None for an engine without a prefix cache."""
        return None

    @abc.abstractmethod
    def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenDelta, None]:
        """Token deltas as the engine produces them; ends after the one with a finish_reason.

        Continues after `request.resume_token_ids` when there are any. Like vLLM, refuses a
        request id that is already running. `prompt_tokens` counts the prompt alone."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None: ...

    @abc.abstractmethod
    async def shutdown(self) -> None: ...
