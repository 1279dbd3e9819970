"""The dead-letter stream of a model: list, retry (re-enqueue) and drop requests in it."""

from __future__ import annotations

import time
from dataclasses import dataclass

from redis.asyncio import Redis

from sluice.broker.keys import ModelKeys
from sluice.broker.messages import RequestMessage


@dataclass
class DeadLetter:
    entry_id: str
    request_id: str
    error: str
    attempts: int
    failed_at: float
    stream: str
    message: RequestMessage


class DeadLetters:
    def __init__(self, redis: Redis, model: str):
        self.redis = redis
        self.keys = ModelKeys(model)

    async def list(self, count: int = 1000) -> list[DeadLetter]:
        entries = await self.redis.xrange(self.keys.dead_letters, count=count)
        return [
            DeadLetter(eid, f["id"], f.get("error", ""), int(f.get("attempts", 0)), float(f.get("failed_at", 0)),
                       f.get("stream", self.keys.requests), RequestMessage.model_validate_json(f["data"]))
            for eid, f in entries
        ]

    async def _select(self, request_ids: list[str] | None) -> list[DeadLetter]:
        letters = await self.list(count=100_000)
        if request_ids is None:
            return letters
        wanted = set(request_ids)
        return [d for d in letters if d.request_id in wanted]

    async def retry(self, request_ids: list[str] | None) -> list[str]:
        """Put requests back on their stream as new deliveries (a fresh deadline of the same
        length); their status returns to queued and their old reply stream is cleared."""
        retried = []
        for d in await self._select(request_ids):
            now = time.time()
            msg = d.message.model_copy(update={
                "enqueued_at": now, "deadline": now + (d.message.deadline - d.message.enqueued_at)})
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.delete(self.keys.reply(d.request_id))
                pipe.hdel(self.keys.status(d.request_id), "result", "finished_at", "started_at", "worker")
                pipe.hset(self.keys.status(d.request_id), mapping={"state": "queued", "enqueued_at": now})
                pipe.xadd(d.stream, msg.to_fields())
                pipe.xdel(self.keys.dead_letters, d.entry_id)
                await pipe.execute()
            retried.append(d.request_id)
        return retried

    async def drop(self, request_ids: list[str] | None) -> list[str]:
        letters = await self._select(request_ids)
        if letters:
            await self.redis.xdel(self.keys.dead_letters, *(d.entry_id for d in letters))
        return [d.request_id for d in letters]
