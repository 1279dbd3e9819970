"""A null engine: no model, N tokens at once. For tests of the queue and for measuring its cost."""

from __future__ import annotations

import asyncio
import logging
import os
import zlib
from collections.abc import AsyncGenerator

from sluice.config.engine import DEFAULT_BLOCK_SIZE
from sluice.protocol.messages import TokenLogprob
from sluice.protocol.prefix import block_hashes
from sluice.workers.engines.base import Engine, GenerationRequest, TokenDelta
from sluice.workers.engines.prefix_cache import PrefixCacheCounters, SimulatedPrefixCache

log = logging.getLogger(__name__)


class NullEngine(Engine):
    """Answers every request with `max_tokens` tokens (" t0 t1 ...") in one delta, after `delay_s`.

    As strict as vLLM where the queue depends on it: a request id that is already running is
    refused. `token_delay_s` streams one token at a time instead (to exercise deltas, cancels
    and crashes mid-generation), in steps as a GPU engine makes them: every `token_delay_s`, one
    token for every request running, handed out together; `composition` makes each token
    depend on how many requests are in the engine when it is produced (" t3.2": token 3, two
    running; its id 3002), as a real
    engine's tokens can change with batch composition, so that a retry regenerating tokens
    instead of resuming after them shows (in its text and, as strictly as a real engine, in its
    token ids); `crash_on` kills the process on a prompt containing it, like
    a request that brings its engine down.

    `prefix_cache_blocks` gives it a simulated prefix cache of that many blocks (its tokens are the
    prompt's words), and `prefill_s_per_token` a prefill time per prompt token the cache does not
    hold: placement then shows in its latency and in the hit counters it reports as vLLM does.
    """

    def __init__(self, delay_s: float = 0.0, token_delay_s: float = 0.0, crash_on: str | None = None,
                 composition: bool = False, *, prefix_cache_blocks: int = 0, prefill_s_per_token: float = 0.0,
                 block_size: int = DEFAULT_BLOCK_SIZE):
        self.delay_s = delay_s
        self.prefill_s_per_token = prefill_s_per_token
        self.prefix_cache = (SimulatedPrefixCache(prefix_cache_blocks, block_size) if prefix_cache_blocks
                             else None)
        self.token_delay_s = token_delay_s
        self.crash_on = crash_on
        self.composition = composition
        self._aborted: set[str] = set()
        self._running: set[str] = set()
        self._steps = _Steps(token_delay_s)

    async def start(self) -> None:
        return None

    def _token(self, i: int) -> tuple[int, str]:
        """Token i's id and text (with composition, both depend on the batch)."""
        if not self.composition:
            return i, f" t{i}"
        return i * 1000 + len(self._running), f" t{i}.{len(self._running)}"

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenDelta, None]:
        if request.request_id in self._running:
            raise ValueError(f"Request id {request.request_id} already running.")
        self._running.add(request.request_id)
        try:
            async for delta in self._generate(request):
                yield delta
        finally:
            self._running.discard(request.request_id)
            self._aborted.discard(request.request_id)

    async def _generate(self, request: GenerationRequest) -> AsyncGenerator[TokenDelta, None]:
        if self.crash_on and self.crash_on in request.prompt:
            log.critical("null engine: crashing on request %s, as configured", request.request_id)
            os._exit(70)
        prompt_tokens = len(request.prompt.split())
        prefill_s = self._prefill(request.prompt, prompt_tokens)
        if self.delay_s or prefill_s:
            await asyncio.sleep(self.delay_s + prefill_s)
        first = len(request.resume_token_ids)
        last = first + request.max_tokens
        prompt_lp = _prompt_logprobs(request) if request.prompt_logprobs is not None else None
        if not self.token_delay_s:
            tokens = [self._token(i) for i in range(first, last)]
            ids, texts = [token for token, _ in tokens], [text for _, text in tokens]
            yield TokenDelta("".join(texts), ids, "length", prompt_tokens, _logprobs(request, texts),
                             prompt_lp)
            return
        step = self._steps.next_step()
        for i in range(first, last):
            if (made := self._steps.made(step)) is not None:  # not made yet: wait for the step
                await made
            step += 1
            if request.request_id in self._aborted:
                yield TokenDelta("", [], "abort", prompt_tokens if i == first else None)
                return
            token, text = self._token(i)
            yield TokenDelta(text, [token], "length" if i == last - 1 else None,
                             prompt_tokens if i == first else None, _logprobs(request, [text]),
                             prompt_lp if i == first else None)

    def _prefill(self, prompt: str, prompt_tokens: int) -> float:
        """The prefill time of this prompt: its tokens the simulated cache does not hold (all of
        them without one), each `prefill_s_per_token`."""
        if self.prefix_cache is None:
            return self.prefill_s_per_token * prompt_tokens
        ids = [zlib.crc32(word.encode()) for word in prompt.split()]
        blocks = block_hashes(ids, self.prefix_cache.block_size)
        return self.prefill_s_per_token * (prompt_tokens - self.prefix_cache.admit(blocks, prompt_tokens))

    def prefix_cache_counters(self) -> PrefixCacheCounters | None:
        return self.prefix_cache.counters if self.prefix_cache is not None else None

    async def abort(self, request_id: str) -> None:
        if request_id in self._running:
            self._aborted.add(request_id)

    async def shutdown(self) -> None:
        return None


class _Steps:
    """The engine's steps, on the engine's own clock: one every `interval_s` (on a grid from its
    first use), whatever the worker's event loop is doing, as a GPU engine steps in its own
    process. Every request running gets a token per step; the waiters of a step get theirs
    together (one timer a step, not one a token), so a worker sees a step's tokens as it would
    from a GPU engine: all in one turn of its event loop. A request whose worker comes for a
    token after its step was taken (its loop busy) gets it at once, as vLLM's output queue
    holds what the engine made meanwhile: the engine's pace is not the worker's, and
    `sluice bench tokens` measures whether the worker keeps up with it."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._epoch = 0.0
        self._taken = -1  # the last step whose timer has run
        self._waiting: dict[int, list[asyncio.Future[None]]] = {}

    def _on_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # (an engine used again on another loop: its old steps never come)
            self._loop, self._epoch, self._taken, self._waiting = loop, loop.time(), -1, {}
        return loop

    def next_step(self) -> int:
        """The step that makes the first token of a request starting now."""
        loop = self._on_loop()
        return max(self._taken + 1, int((loop.time() - self._epoch) / self.interval_s) + 1)

    def made(self, step: int) -> asyncio.Future[None] | None:
        """None once `step` was taken; else a future done when it is (one each: a waiter
        cancelled leaves the others waiting)."""
        loop = self._on_loop()
        at = self._epoch + step * self.interval_s
        if step <= self._taken or loop.time() >= at:
            return None
        fut = loop.create_future()
        waiting = self._waiting.get(step)
        if waiting is None:
            waiting = self._waiting[step] = []
            loop.call_at(at, self._take, step)
        waiting.append(fut)
        return fut

    def _take(self, step: int) -> None:
        self._taken = max(self._taken, step)
        for fut in self._waiting.pop(step, ()):
            if not fut.done():
                fut.set_result(None)


def _logprobs(request: GenerationRequest, texts: list[str]) -> list[TokenLogprob] | None:
    """Made-up log probabilities of the shapes vLLM returns: the chosen token first at -0.5,
    then alternatives one nat apart."""
    if request.logprobs is None:
        return None
    k = request.logprobs
    alternatives = [(f" alt{j}", -0.5 - j) for j in range(1, k)]
    return [TokenLogprob(token=t, logprob=-0.5, top=[(t, -0.5), *alternatives][:k]) for t in texts]


def _prompt_logprobs(request: GenerationRequest) -> list[TokenLogprob]:
    words = request.prompt.split(" ")
    words = words[:1] + [f" {w}" for w in words[1:]]  # joined, they are the prompt
    return [TokenLogprob(token=w, logprob=None if k == 0 else -2.0) for k, w in enumerate(words)]
