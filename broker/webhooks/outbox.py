"""Webhooks in Redis: the key names, the outboxes the final-writing scripts append to, and which
owners have an endpoint (the admission's mark). Endpoints are broker/webhooks/endpoints.py; the
deliveries broker/webhooks/deliveries.py. docs/webhooks.md tells the whole story."""

from __future__ import annotations

import time

from redis.asyncio import Redis

from sluice.broker.keys import PREFIX, ModelKeys
from sluice.broker.plumbing import hash_of

GROUP = "senders"
# Every webhook key but the outboxes shares one hash tag: the delivery scripts touch one slot.
TAG = f"{PREFIX}:{{webhooks}}"
ENDPOINTS = f"{TAG}:endpoints"  # hash: endpoint id -> endpoint JSON
OWNERS = f"{TAG}:owners"  # hash: owner ('' without keys) -> how many endpoints it has
BATCHES = f"{TAG}:batches"  # sorted set: batch ids whose final may carry an event, by time
DUE = f"{TAG}:due"  # sorted set: delivery id -> when it is due (or its lease ends)
DEAD = f"{TAG}:dead"  # list: deliveries that used up their retry period, newest first


def outcomes(minute: int) -> str:
    """Hash: deliveries settled in that minute (epoch seconds // 60) by outcome, for the dashboard."""
    return f"{TAG}:outcomes:{minute}"


def delivery(delivery_id: str) -> str:
    """A delivery's hash: endpoint, event, attempts, first attempt, last error."""
    return f"{TAG}:delivery:{delivery_id}"


def outbox(keys: ModelKeys) -> str:
    """A shard's outbox stream (the slot of the statuses whose finals append to it)."""
    return f"{keys.tag}:outbox"


def batch_outbox(job_id: str) -> str:
    """A batch's own outbox, in the slot of its hash (job_move.lua, job_cancel.lua)."""
    return f"{{{PREFIX}:batch:{job_id}}}:outbox"


# How stale an api process's list of owners with endpoints may be. An endpoint's creation (and its
# enabling) returns only this long (and a margin) after its write (EndpointStore.settle), so that a
# request admitted after it returned is marked whichever api admits it: no command per request.
OWNERS_REFRESH_S = 0.5


class SubscribedOwners:
    """Which owners have a webhook endpoint, read from Redis at most every `refresh_s` (one HGETALL
    per process, not per request): admission asks it to mark a request whose final must append
    an event, so a request of an owner without one costs no command more.

    Why a request admitted after an endpoint's creation returned is always marked: the read's
    time is taken before the read is sent, so a list that misses the endpoint was sent before
    its write, and is used at most `refresh_s` after that: before the creation returned."""

    def __init__(self, redis: Redis, refresh_s: float = OWNERS_REFRESH_S) -> None:
        self.redis = redis
        self.refresh_s = refresh_s
        self._owners: frozenset[str] = frozenset()
        self._read_at = float("-inf")

    async def has(self, owner: str | None) -> bool:
        if time.monotonic() - self._read_at > self.refresh_s:
            sent_at = time.monotonic()
            counts = hash_of(await self.redis.hgetall(OWNERS))
            self._owners = frozenset(o for o, n in counts.items() if int(n) > 0)
            self._read_at = sent_at
        return (owner or "") in self._owners

    async def mark(self, owner: str | None, lane: str) -> str:
        """A status's `hook` ('1', or '' for none): admission's rule, a job's row has none."""
        return "1" if lane != "bulk" and await self.has(owner) else ""
