"""Webhook endpoints in Redis (`sluice:{webhooks}:endpoints`): an owner's URL, the event types it
wants and its signing secret. Every change rebuilds the owners' count (`webhooks.OWNERS`) in the
same transaction: admission marks the requests of the owners it lists. A change that adds an
owner's endpoint returns once every api process has seen it (`settle`)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import asdict, dataclass, field

from redis.asyncio import Redis
from redis.exceptions import WatchError

from sluice.broker.webhooks.outbox import ENDPOINTS, OWNERS, OWNERS_REFRESH_S
from sluice.protocol.webhooks import new_secret

ROTATION_GRACE_S = 24 * 3600  # a rotated secret still signs (beside the new one) this long


@dataclass
class Endpoint:
    id: str
    url: str
    events: list[str]
    owner: str  # the digest of the key whose requests it hears of ('' without keys)
    secret: str
    enabled: bool = True
    description: str = ""
    created_at: int = field(default_factory=lambda: int(time.time()))
    previous_secret: str = ""  # the secret before the last rotation, until previous_until
    previous_until: int = 0

    def public(self) -> dict:
        """What a listing shows: never a secret."""
        out = asdict(self)
        for k in ("secret", "previous_secret", "previous_until"):
            out.pop(k)
        return {"object": "webhook_endpoint", **out}

    def signing_secrets(self, now: float) -> list[str]:
        """The secrets a delivery is signed with: the current one, and during a rotation's
        grace period the previous one too (a receiver not yet updated still verifies)."""
        if self.previous_secret and now < self.previous_until:
            return [self.secret, self.previous_secret]
        return [self.secret]

    def wants(self, event_type: str) -> bool:
        return self.enabled and (not self.events or "*" in self.events or event_type in self.events)


class EndpointStore:
    def __init__(self, redis: Redis) -> None:
        self.redis = redis

    async def create(self, url: str, events: list[str], owner: str, description: str = "") -> Endpoint:
        endpoint = Endpoint(id=f"we_{uuid.uuid4().hex}", url=url, events=sorted(set(events)), owner=owner,
                            secret=new_secret(), description=description)
        await self._save(endpoint)
        await self.settle()
        return endpoint

    async def settle(self) -> None:
        """Wait until every api process's list of owners with endpoints was read after the last
        write (broker/webhooks/outbox.py SubscribedOwners): a request admitted after this returns has
        its event. A tenth more for clocks that run at slightly different rates."""
        await asyncio.sleep(OWNERS_REFRESH_S * 1.1)

    async def get(self, endpoint_id: str) -> Endpoint | None:
        raw = await self.redis.hget(ENDPOINTS, endpoint_id)
        return Endpoint(**json.loads(raw)) if raw else None

    async def list(self, owner: str | None = None) -> list[Endpoint]:
        found = [Endpoint(**json.loads(v)) for v in (await self.redis.hgetall(ENDPOINTS)).values()]
        return sorted((e for e in found if owner is None or e.owner == owner),
                      key=lambda e: (e.created_at, e.id))

    async def rotate(self, endpoint_id: str) -> Endpoint | None:
        endpoint = await self.get(endpoint_id)
        if endpoint is None:
            return None
        endpoint.previous_secret = endpoint.secret
        endpoint.previous_until = int(time.time()) + ROTATION_GRACE_S
        endpoint.secret = new_secret()
        await self._save(endpoint)
        return endpoint

    async def set_enabled(self, endpoint_id: str, enabled: bool) -> Endpoint | None:
        endpoint = await self.get(endpoint_id)
        if endpoint is None:
            return None
        endpoint.enabled = enabled
        await self._save(endpoint)
        if enabled:
            await self.settle()
        return endpoint

    async def delete(self, endpoint_id: str) -> bool:
        return await self._write(endpoint_id, None)

    async def _save(self, endpoint: Endpoint) -> None:
        await self._write(endpoint.id, json.dumps(asdict(endpoint)))

    async def _write(self, endpoint_id: str, value: str | None) -> bool:
        """Set (or delete, `value` None) one endpoint and rebuild the owners' counts, at once
        (WATCH: a concurrent change makes it run again). Returns whether the endpoint was there."""
        while True:
            async with self.redis.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(ENDPOINTS)
                    every = await pipe.hgetall(ENDPOINTS)
                    was = endpoint_id in every
                    if value is None:
                        every.pop(endpoint_id, None)
                    else:
                        every[endpoint_id] = value
                    pipe.multi()
                    if value is None:
                        pipe.hdel(ENDPOINTS, endpoint_id)
                    else:
                        pipe.hset(ENDPOINTS, endpoint_id, value)
                    counts: dict[str, int] = {}
                    for e in map(json.loads, every.values()):
                        counts[e["owner"]] = counts.get(e["owner"], 0) + (1 if e["enabled"] else 0)
                    pipe.delete(OWNERS)
                    if any(counts.values()):
                        pipe.hset(OWNERS, mapping={o: n for o, n in counts.items() if n})
                    await pipe.execute()
                    return was
                except WatchError:
                    continue
