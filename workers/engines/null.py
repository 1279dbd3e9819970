"""A null engine: no model, N tokens at once. For tests of the queue and for measuring its cost."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator

from sluice.workers.engines.base import Engine, GenerationRequest, TokenDelta

log = logging.getLogger(__name__)


class NullEngine(Engine):
    """Answers every request with `max_tokens` tokens (" t0 t1 ...") in one delta, after `delay_s`.

    `token_delay_s` streams one token at a time instead (to exercise deltas, cancels and
    crashes mid-generation); `crash_on` kills the process on a prompt containing it, like a
    request that brings its engine down.
    """

    def __init__(self, delay_s: float = 0.0, token_delay_s: float = 0.0, crash_on: str | None = None):
        self.delay_s = delay_s
        self.token_delay_s = token_delay_s
        self.crash_on = crash_on
        self._aborted: set[str] = set()

    async def start(self) -> None:
        return None

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        if self.crash_on and self.crash_on in request.prompt:
            log.critical("null engine: crashing on request %s, as configured", request.request_id)
            os._exit(70)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        n = request.max_tokens
        prompt_tokens = len(request.prompt.split())
        if not self.token_delay_s:
            yield TokenDelta("".join(f" t{i}" for i in range(n)), list(range(n)), "length", prompt_tokens)
            return
        for i in range(n):
            await asyncio.sleep(self.token_delay_s)
            if request.request_id in self._aborted:
                self._aborted.discard(request.request_id)
                yield TokenDelta("", [], "abort", prompt_tokens if i == 0 else None)
                return
            last = i == n - 1
            yield TokenDelta(f" t{i}", [i], "length" if last else None, prompt_tokens if i == 0 else None)

    async def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)

    async def shutdown(self) -> None:
        return None
