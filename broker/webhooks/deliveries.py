"""Webhook deliveries in Redis: an outbox event becomes one delivery per endpoint that wants it
(webhook_enqueue.lua); senders lease the due ones (webhook_claim.lua), and settle each attempt:
done, retried later, or moved to the dead-letter list (webhook_settle.lua). A sender that dies
holding a delivery loses nothing: its lease ends and another sender takes it."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass

from redis.asyncio import Redis

from sluice.broker.plumbing import Scripts, members, texts
from sluice.broker.webhooks.calls import NewDelivery, WebhookClaim, WebhookEnqueue, WebhookSettle
from sluice.broker.webhooks.outbox import DEAD, DUE, delivery, outcomes

DEAD_MAX = 10_000  # dead deliveries kept for `sluice webhooks dead`
OUTCOME_MINUTES = 10  # the dashboard's deliveries by outcome: over this many minutes
COUNTED = {"ok": "delivered", "retry": "retried", "dead": "dead"}  # 'later' counts no attempt


def event_id(stream: str, entry_id: str) -> str:
    """An event's `webhook-id`: the same for every delivery and every attempt of it (a duplicate
    carries the id of its first), and unique across outboxes."""
    return "msg_" + hashlib.sha256(f"{stream}\n{entry_id}".encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Delivery:
    id: str  # its hash's key
    endpoint: str
    event_id: str
    body: str
    attempts: int
    first_at: float


class Deliveries:
    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self.scripts = Scripts(redis)

    async def enqueue(self, deliveries: list[tuple[str, str, str]], lease_s: float) -> list[str]:
        """(endpoint id, event id, body) for each endpoint of one event; returns the ids of those
        created now (leased to the caller, to post at once)."""
        if not deliveries:
            return []
        now = time.time()
        return await self.scripts(WebhookEnqueue(
            due=DUE, lease_until=now + lease_s, now=now,
            deliveries=tuple(NewDelivery(delivery=delivery(f"{endpoint}:{event}"), endpoint=endpoint,
                                         event_id=event, body=body) for endpoint, event, body in deliveries)))

    async def claim(self, count: int, lease_s: float) -> list[Delivery]:
        now = time.time()
        ids = await self.scripts(WebhookClaim(due=DUE, now=now, lease_until=now + lease_s, count=count))
        return await self.get(ids)

    async def get(self, ids: list[str]) -> list[Delivery]:
        if not ids:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for i in ids:
                pipe.hgetall(i)
            found = await pipe.execute()
        return [Delivery(i, d["endpoint"], d["event_id"], d["body"], int(d.get("attempts", 0)),
                         float(d.get("first_at", 0))) for i, d in zip(ids, found) if d]

    async def settle(self, d: Delivery, outcome: str, *, next_at: float = 0, error: str = "",
                     counted: str | None = None) -> bool:
        """`counted`: the outcome the dashboard counts it as (by default `outcome`'s: delivered,
        retried, dead; 'dropped' for a delivery whose endpoint was deleted)."""
        now = time.time()
        counted = COUNTED.get(outcome, "") if counted is None else counted
        return bool(await self.scripts(WebhookSettle(
            due=DUE, delivery=d.id, dead=DEAD, counts=outcomes(int(now // 60)), outcome=outcome,
            next_at=next_at, err=error[:500], now=now, dead_max=DEAD_MAX, counted=counted,
            counts_ttl=(OUTCOME_MINUTES + 1) * 60)))

    async def outcomes(self) -> dict[str, int]:
        """Deliveries settled over the last OUTCOME_MINUTES minutes, by outcome."""
        minute = int(time.time() // 60)
        async with self.redis.pipeline(transaction=False) as pipe:
            for m in range(minute - OUTCOME_MINUTES + 1, minute + 1):
                pipe.hgetall(outcomes(m))
            found = await pipe.execute()
        totals = dict.fromkeys(("delivered", "retried", "dead", "dropped"), 0)
        for counts in found:
            for k, v in counts.items():
                totals[k] = totals.get(k, 0) + int(v)
        return totals

    async def backlog(self) -> tuple[int, float]:
        """Deliveries not done (first attempts in flight and retries), and the age of the oldest
        one's event (s; 0 for none)."""
        count = await self.redis.zcard(DUE)
        oldest = 0.0
        if count:
            ids = members(await self.redis.zrange(DUE, 0, 99))
            async with self.redis.pipeline(transaction=False) as pipe:
                for i in ids:
                    pipe.hget(i, "first_at")
                firsts = [float(f) for f in await pipe.execute() if f]
            oldest = time.time() - min(firsts) if firsts else 0.0
        return count, max(oldest, 0.0)

    async def dead(self, count: int = 100) -> list[dict]:
        return [json.loads(x) for x in await self.redis.lrange(DEAD, 0, count - 1)]

    async def replay(self, ids: list[str] | None = None) -> int:
        """Put dead deliveries (all, or those named) back as due now, with a fresh retry period;
        returns how many."""
        replayed = 0
        for raw in texts(await self.redis.lrange(DEAD, 0, -1)):
            letter = json.loads(raw)
            if ids is not None and letter["id"] not in ids and letter.get("event_id") not in ids:
                continue
            now = time.time()
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hset(letter["id"], mapping={"endpoint": letter["endpoint"],
                                                 "event_id": letter["event_id"], "body": letter["body"],
                                                 "attempts": 0, "first_at": now})
                pipe.zadd(DUE, {letter["id"]: now})
                pipe.lrem(DEAD, 1, raw)
                await pipe.execute()
            replayed += 1
        return replayed
