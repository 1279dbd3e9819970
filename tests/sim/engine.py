"""The simulation's engine: tokens come when the scheduler feeds a row a chunk size.

A structured row's tokens depend only on their index (a grammar regenerated from token 0 with
the same seed repeats itself); a plain row's tokens also carry the engine's salt (one per
worker process): a retry that regenerated tokens instead of resuming after them shows."""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncIterator

from sluice.workers.engines.base import Engine, GenerationRequest, TokenDelta

ABORT = -1


def token(tag: str, row_tag: str, i: int) -> tuple[str, int]:
    """The text and id of token `i`."""
    return f" {tag}{i}", zlib.crc32(f"{row_tag}:{tag}:{i}".encode()) % 50_000


class SimEngine(Engine):
    def __init__(self, salt: str) -> None:
        self.salt = salt
        self.feeds: dict[str, asyncio.Queue[int]] = {}  # engine request id -> chunk sizes

    async def start(self) -> None:
        return None

    async def shutdown(self) -> None:
        return None

    async def abort(self, request_id: str) -> None:
        if (feed := self.feeds.get(request_id)) is not None:
            feed.put_nowait(ABORT)

    def feed(self, request_id: str, n: int) -> bool:
        if (feed := self.feeds.get(request_id)) is None:
            return False
        feed.put_nowait(n)
        return True

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        feed = self.feeds[request.request_id] = asyncio.Queue()
        tag = "s" if request.structured is not None else self.salt
        at, left, first = len(request.resume_token_ids), request.max_tokens, True
        try:
            while left > 0:
                n = await feed.get()
                if n == ABORT:
                    yield TokenDelta("", [], finish_reason="abort")
                    return
                n = min(n, left)
                tokens = [token(tag, request.request_id, j) for j in range(at, at + n)]
                at, left = at + n, left - n
                yield TokenDelta("".join(t for t, _ in tokens), [i for _, i in tokens],
                                 finish_reason="length" if left == 0 else None,
                                 prompt_tokens=3 if first else None)
                first = False
        finally:
            self.feeds.pop(request.request_id, None)
