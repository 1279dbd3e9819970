"""The api side of a request: admit it onto the stream, cancel it, read its status."""

from __future__ import annotations

import time
from typing import Any

from redis.asyncio import Redis

from sluice.broker.keys import DONE_CHANNEL, ModelKeys
from sluice.broker.messages import RequestMessage
from sluice.broker.scripts import Scripts


class QueueFull(Exception):
    """The model's stream holds its bound of waiting requests."""


class Admission:
    def __init__(self, redis: Redis, *, status_ttl_s: int, reply_ttl_s: int, cancel_ttl_s: int):
        self.redis = redis
        self.scripts = Scripts.register(redis)
        self.status_ttl_s = status_ttl_s
        self.reply_ttl_s = reply_ttl_s
        self.cancel_ttl_s = cancel_ttl_s

    async def submit(self, message: RequestMessage, *, max_queued: int) -> str:
        """XADD the request unless the bound is reached; returns the stream entry id."""
        keys = ModelKeys(message.model)
        stream = keys.bulk if message.lane == "bulk" else keys.requests
        entry = await self.scripts.admit(
            keys=[stream, keys.status(message.id)],
            args=[max_queued, message.id, message.model_dump_json(), self.status_ttl_s,
                  message.enqueued_at, message.model, message.lane],
        )
        if entry is None:
            raise QueueFull(message.model)
        return entry

    async def cancel(self, model: str, rid: str) -> str | None:
        """Returns the resulting state ('cancelled', 'cancelling', or the final one), None if unknown."""
        keys = ModelKeys(model)
        return await self.scripts.cancel(
            keys=[keys.status(rid), keys.cancel(rid), keys.reply(rid)],
            args=[time.time(), self.cancel_ttl_s, self.status_ttl_s, self.reply_ttl_s, DONE_CHANNEL, rid],
        )

    async def status(self, model: str, rid: str) -> dict[str, Any]:
        return await self.redis.hgetall(ModelKeys(model).status(rid))

    async def find_model(self, rid: str, models: list[str]) -> str | None:
        """Which model a request id belongs to (ids do not name their model)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for m in models:
                pipe.exists(ModelKeys(m).status(rid))
            found = await pipe.execute()
        return next((m for m, hit in zip(models, found) if hit), None)
