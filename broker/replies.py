"""Reply channels: one stream per request carrying token deltas, then one final event."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from redis.asyncio import Redis

from sluice.broker.keys import ModelKeys
from sluice.broker.messages import DeltaEvent, FinalResult

log = logging.getLogger(__name__)


class ReplyWriter:
    """Buffers token deltas and writes everything ready in one pipeline per flush.

    The engine hands out a token for many requests per step; one round trip per step
    (instead of one per token) keeps Redis off the engine's critical path.
    """

    def __init__(self, redis: Redis, model: str, *, reply_ttl_s: int):
        self.redis = redis
        self.keys = ModelKeys(model)
        self.reply_ttl_s = reply_ttl_s
        self._buffer: list[tuple[str, DeltaEvent]] = []
        self._ready = asyncio.Event()
        self._closing = False
        self._lock = asyncio.Lock()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="reply-writer")

    def delta(self, rid: str, event: DeltaEvent) -> None:
        self._buffer.append((rid, event))
        self._ready.set()

    async def flush(self) -> None:
        """Write what is buffered now (called before a request's commit, so deltas precede the final)."""
        # The lock makes a flush wait for a write in progress: deltas must precede the final.
        async with self._lock:
            if not self._buffer:
                return
            batch, self._buffer = _coalesce(self._buffer), []
            async with self.redis.pipeline(transaction=False) as pipe:
                for rid, ev in batch:
                    key = self.keys.reply(rid)
                    pipe.xadd(key, {"kind": "delta", "data": ev.model_dump_json()})
                    if ev.i == 0:
                        pipe.expire(key, self.reply_ttl_s)
                await pipe.execute()

    async def _run(self) -> None:
        while not self._closing:
            await self._ready.wait()
            self._ready.clear()
            try:
                await self.flush()
            except Exception:  # a Redis blip must not kill the writer; the final still lands
                log.exception("writing token deltas failed")
                await asyncio.sleep(0.1)

    async def close(self, timeout_s: float = 2.0) -> None:
        """Stop the writer (on a flag: see Worker.run) and write what is left."""
        self._closing = True
        self._ready.set()
        if self._task:
            _, late = await asyncio.wait([self._task], timeout=timeout_s)
            for task in late:
                task.cancel()
        await self.flush()


def _coalesce(buffer: list[tuple[str, DeltaEvent]]) -> list[tuple[str, DeltaEvent]]:
    """Join the buffered deltas of each (request, row) into one: when writes lag behind the
    engine, fewer and larger entries keep Redis and the readers from falling further behind."""
    out: list[tuple[str, DeltaEvent]] = []
    last: dict[tuple[str, int], int] = {}  # (request, row) -> its latest position in out
    for rid, ev in buffer:
        at = last.get((rid, ev.row))
        prev = out[at][1] if at is not None else None
        if prev is not None and prev.attempt == ev.attempt and prev.i + len(prev.token_ids) == ev.i:
            out[at] = (rid, prev.model_copy(update={
                "text": prev.text + ev.text, "token_ids": prev.token_ids + ev.token_ids}))
        else:
            last[(rid, ev.row)] = len(out)
            out.append((rid, ev))
    return out


@dataclass
class ReplyEvent:
    entry_id: str
    kind: str  # "delta" | "final"
    delta: DeltaEvent | None = None
    final: FinalResult | None = None


async def read_replies(
    redis: Redis,
    model: str,
    rid: str,
    *,
    after: str = "0",
    next_index: int = 0,
    block_ms: int = 1000,
    idle_timeout_s: float | None = None,
) -> AsyncIterator[ReplyEvent]:
    """Follow a reply stream from entry `after` until the final event.

    Token deltas whose indices were already delivered (a retried attempt replays the same
    seed) are skipped, so each token reaches the reader once.
    """
    key = ModelKeys(model).reply(rid)
    seen = {0: next_index}  # per row: the next token index not yet delivered
    waited = 0.0
    while True:
        got = await redis.xread({key: after}, count=256, block=block_ms)
        if not got:
            waited += block_ms / 1000
            if idle_timeout_s is not None and waited >= idle_timeout_s:
                return
            continue
        waited = 0.0
        for entry_id, fields in got[0][1]:
            after = entry_id
            if fields.get("kind") == "final":
                yield ReplyEvent(entry_id, "final", final=FinalResult.model_validate_json(fields["data"]))
                return
            ev = DeltaEvent.model_validate_json(fields["data"])
            # A delta overlapping tokens already delivered is skipped whole: its text
            # cannot be split per token, and the same seed regenerates the same tokens.
            if ev.i < seen.get(ev.row, 0):
                continue
            seen[ev.row] = ev.i + len(ev.token_ids)
            yield ReplyEvent(entry_id, "delta", delta=ev)


async def resume_index(redis: Redis, model: str, rid: str, last_id: str) -> int:
    """The next token index after reply entry `last_id` (for SSE Last-Event-ID)."""
    key = ModelKeys(model).reply(rid)
    got = await redis.xrange(key, min=last_id, max=last_id, count=1)
    if not got:
        return 0
    fields = got[0][1]
    if fields.get("kind") != "delta":
        return 0
    ev = DeltaEvent.model_validate_json(fields["data"])
    return ev.i + len(ev.token_ids)
