"""The Responses API's record of a response beside its request: what the response object
repeats of the request (instructions, metadata, text format ...). It lives as long as the
request's status can (an unfinished request's status TTL plus a result's), so a response
outlives an api restart with everything else in Redis."""

from __future__ import annotations

import json
from typing import Any

from redis.asyncio import Redis

from sluice.broker.keys import ModelKeys


class ResponseRecords:
    def __init__(self, redis: Redis, *, ttl_s: int) -> None:
        self.redis = redis
        self.ttl_s = ttl_s

    async def save(self, model: str, rid: str, meta: dict[str, Any]) -> None:
        await self.redis.set(ModelKeys(model).response(rid), json.dumps(meta), ex=self.ttl_s)

    async def load(self, model: str, rid: str) -> dict[str, Any] | None:
        raw = await self.redis.get(ModelKeys(model).response(rid))
        return json.loads(raw) if raw else None

    async def delete(self, model: str, rid: str) -> bool:
        return bool(await self.redis.delete(ModelKeys(model).response(rid)))
