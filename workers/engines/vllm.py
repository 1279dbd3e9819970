"""vLLM's AsyncLLMEngine behind the Engine interface, built from a model's VLLMConfig."""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from sluice.config.engine import VLLMConfig
from sluice.protocol.messages import Sampled, TokenLogprob
from sluice.workers.engines.base import Engine, GenerationRequest, TokenDelta
from sluice.workers.engines.prefix_cache import PrefixCacheCounters
from sluice.workers.engines.tool_calls import parse_tool_calls

log = logging.getLogger(__name__)

# GenerationRequest fields that are SamplingParams keywords of the same name and meaning (its
# `sampling` fields are too, every one: sampling_keywords).
_SAMPLING = ("max_tokens", "seed", "logprobs", "prompt_logprobs")


def sampling_keywords(request: GenerationRequest) -> dict[str, Any]:
    """SamplingParams keywords for a request, but for its constraint and the output kind."""
    return {**{name: getattr(request, name) for name in _SAMPLING}, **request.sampling.model_dump(),
            "stop": request.sampling.stop or None}


# VLLMConfig fields handled here rather than passed through as AsyncEngineArgs of the same name.
_NOT_ENGINE_ARGS = {"cpu_kvcache_space_gib", "extra_engine_args", "device_group"}


def engine_args(model_path: str, config: VLLMConfig) -> tuple[dict[str, Any], list[str]]:
    """AsyncEngineArgs keywords for this vLLM, and the options set in the deployment that it does not
    know (reported, not dropped silently). An option it does not know that only has VLLMConfig's
    default (max_seq_len_to_capture, gone from vLLM) is left out without a word: no deployment
    asked for it, and a warning at every start would say nothing the user can act on."""
    from vllm import AsyncEngineArgs

    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    wanted = config.model_dump(exclude=_NOT_ENGINE_ARGS)
    wanted.update(config.extra_engine_args)
    kwargs: dict[str, Any] = {"model": model_path, "disable_log_stats": True}
    ignored = []
    asked = config.model_fields_set | set(config.extra_engine_args)
    for name, value in wanted.items():
        if name not in known:
            if name in asked:
                ignored.append(name)
        elif value is not None:
            kwargs[name] = value
    if config.device_group is not None:
        ignored.append("device_group")
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and config.cpu_kvcache_space_gib is not None:
        # A fixed KV cache size; gpu_memory_utilization would reserve a share of all RAM.
        kwargs["kv_cache_memory_bytes"] = int(config.cpu_kvcache_space_gib * 2**30)
    return kwargs, ignored


# What start() has vLLM do once before the first request, so that no request waits for it:
# log probabilities (of the output and of the prompt). vLLM ranks each token among the vocabulary
# with a torch.compile'd kernel (vllm.v1.sample.ops.logprobs.batched_count_greater_than) that it
# compiles at the first request asking for them: that request took 7.7 s on a CPU, the next 0.1 s.
# Its batch dimension is left symbolic, so one compilation serves every batch size.
WARM_UP = GenerationRequest(request_id="sluice-warm-up", prompt="Sluice warms up", max_tokens=2,
                            sampling=Sampled(temperature=0), logprobs=1, prompt_logprobs=1)


class VLLMEngine(Engine):
    def __init__(self, model_path: str, config: VLLMConfig):
        self.model_path = model_path
        self.config = config
        self._engine: Any = None
        self._tokenizer: Any = None
        self.warmed_up: list[str] = []  # what start() had the engine load (WARM_UP)
        # Summed by the engine's stat logger (PrefixCacheStatLogger).
        self.prefix_counters = PrefixCacheCounters()

    async def start(self) -> None:
        from vllm import AsyncEngineArgs, AsyncLLMEngine
        kwargs, ignored = engine_args(self.model_path, self.config)
        for name in ignored:
            log.warning("engine option %s is not supported by vLLM %s here: ignored", name, _vllm_version())
        log.info("starting vLLM engine for %s", self.model_path)
        # The engine's own stat loggers stay off (disable_log_stats); ours only sums the prefix
        # cache's counters, which vLLM reports per scheduler step.
        loggers = [prefix_stat_logger(self.prefix_counters)]
        self._engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(**kwargs), stat_loggers=loggers)
        from transformers import AutoTokenizer  # for chat templates; loaded once, off the request path

        self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        await self._warm_up()

    async def _warm_up(self) -> None:
        async with aclosing(self.generate(WARM_UP)) as deltas:
            async for _ in deltas:
                pass
        self.warmed_up = ["logprobs", "prompt_logprobs"]
        log.info("engine warmed up: %s", ", ".join(self.warmed_up))

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        return self._tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                   add_generation_prompt=True)

    def tool_calls(self, row: dict[str, Any], text: str) -> tuple[list[dict[str, Any]], str | None] | None:
        if not row.get("tool_parser") or not row.get("tools"):
            return None
        return parse_tool_calls(self._tokenizer, row["tool_parser"], text, row["messages"], row["tools"])

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenDelta, None]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        structured = None
        if request.structured is not None:
            spec = request.structured
            structured = StructuredOutputsParams(json=spec.json_schema, regex=spec.regex, choice=spec.choice,
                                                 grammar=spec.grammar, json_object=spec.json_object or None)
        params = SamplingParams(
            **sampling_keywords(request),
            structured_outputs=structured,
            output_kind=RequestOutputKind.DELTA,
        )
        prompt: Any = request.prompt
        if request.resume_token_ids:
            # Continue a previous attempt: its delivered tokens follow the prompt's own tokens,
            # tokenized as vLLM would have tokenized the text prompt.
            tokenizer = self._engine.get_tokenizer()
            if inspect.isawaitable(tokenizer):  # a coroutine in older vLLM releases
                tokenizer = await tokenizer
            prompt = {"prompt_token_ids": tokenizer.encode(request.prompt) + list(request.resume_token_ids)}
        prompt = self._rendered(prompt)
        first = True
        # vLLM refuses a priority unless it schedules by priority.
        priority = request.priority if self.config.scheduling_policy == "priority" else 0
        outputs = self._engine.generate(prompt, params, request_id=request.request_id, priority=priority)
        async for out in outputs:
            completion = out.outputs[0]
            yield TokenDelta(
                text=completion.text,
                token_ids=list(completion.token_ids),
                finish_reason=completion.finish_reason if out.finished else None,
                prompt_tokens=(len(out.prompt_token_ids or ()) - len(request.resume_token_ids) if first
                               else None),
                logprobs=(_logprobs(completion.token_ids, completion.logprobs, request.logprobs)
                          if request.logprobs is not None else None),
                prompt_logprobs=(self._prompt_logprobs(out, request.prompt_logprobs)
                                 if first and request.prompt_logprobs is not None else None),
            )
            first = False

    def _rendered(self, prompt: Any) -> Any:
        """The prompt as vLLM's renderer makes it an engine input (tokenized): vLLM deprecates
        raw prompts in generate() and warns at the first one. A vLLM without a renderer takes
        the raw prompt."""
        renderer = getattr(self._engine, "renderer", None)
        if renderer is None or not hasattr(renderer, "render_cmpl"):
            return prompt
        from vllm.renderers.inputs.preprocess import parse_model_prompt

        (rendered,) = renderer.render_cmpl([parse_model_prompt(self._engine.model_config, prompt)],
                                           renderer.default_cmpl_tok_params)
        return rendered

    def _prompt_logprobs(self, out: Any, top: int) -> list[TokenLogprob]:
        """The prompt's tokens with their log probabilities; the first has none (nothing before it)."""
        ids = list(out.prompt_token_ids or ())
        got = _logprobs(ids[1:], (out.prompt_logprobs or [None])[1:], top)
        first = TokenLogprob(token=self._tokenizer.decode(ids[:1]), logprob=None) if ids else None
        return ([first] if first else []) + got

    def prefix_cache_counters(self) -> PrefixCacheCounters | None:
        return self.prefix_counters if self.config.enable_prefix_caching else None

    async def abort(self, request_id: str) -> None:
        if self._engine is not None:
            await self._engine.abort(request_id)

    async def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None


def _logprobs(token_ids: Any, positions: Any, top: int) -> list[TokenLogprob]:
    """vLLM's per-position {token id: Logprob} as TokenLogprobs: the chosen token's, and the
    `top` most likely at that position (vLLM adds the chosen one when it ranks lower)."""
    out = []
    for token_id, candidates in zip(token_ids, positions or []):
        candidates = candidates or {}
        chosen = candidates.get(token_id)
        ranked = (c for c in candidates.values() if c.rank is not None and c.rank <= top)
        best = sorted(ranked, key=lambda c: c.rank)
        out.append(TokenLogprob(token=(chosen.decoded_token or "") if chosen else "",
                                logprob=chosen.logprob if chosen else None,
                                top=[(c.decoded_token or "", c.logprob) for c in best]))
    return out


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


def prefix_stat_logger(counters: PrefixCacheCounters) -> Any:
    """A factory of vLLM stat loggers (vllm.v1.metrics.loggers.StatLoggerBase) that add each
    scheduler step's prefix-cache queries and hits (tokens, PrefixCacheStats) to `counters`, as
    vLLM's own Prometheus logger counts vllm:prefix_cache_queries and vllm:prefix_cache_hits.
    A preempted request's second lookup is left out, as vLLM leaves it out of those. Once the
    engine is up, the cache's size (num_gpu_blocks, set by then, and block_size) goes to `counters` too."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class PrefixCacheStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0):
            self.engine_index, self.vllm_config = engine_index, vllm_config

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            stats = getattr(scheduler_stats, "prefix_cache_stats", None)
            if stats is not None:
                counters.queries += stats.queries
                counters.hits += stats.hits

        def log_engine_initialized(self) -> None:
            cache = self.vllm_config.cache_config
            counters.blocks, counters.block_size = cache.num_gpu_blocks, cache.block_size

    return PrefixCacheStatLogger
