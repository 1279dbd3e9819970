"""A null engine: no model, N tokens at once. For tests of the queue and for measuring its cost."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from sluice.workers.engines.base import Engine, GenerationRequest, TokenDelta


class NullEngine(Engine):
    """Answers every request with `max_tokens` tokens in one delta, after `delay_s`.

    `token_delay_s` instead streams one token at a time (to exercise deltas and cancel).
    """

    def __init__(self, delay_s: float = 0.0, token_delay_s: float = 0.0):
        self.delay_s = delay_s
        self.token_delay_s = token_delay_s
        self._aborted: set[str] = set()

    async def start(self) -> None:
        return None

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        n = request.max_tokens
        prompt_tokens = len(request.prompt.split())
        if not self.token_delay_s:
            yield TokenDelta(" tok" * n, list(range(n)), "length", prompt_tokens)
            return
        for i in range(n):
            await asyncio.sleep(self.token_delay_s)
            if request.request_id in self._aborted:
                self._aborted.discard(request.request_id)
                yield TokenDelta("", [], "abort", prompt_tokens if i == 0 else None)
                return
            last = i == n - 1
            yield TokenDelta(" tok", [i], "length" if last else None, prompt_tokens if i == 0 else None)

    async def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)

    async def shutdown(self) -> None:
        return None
