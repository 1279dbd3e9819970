"""Cancelling a request (cancel.lua): a queued one ends `cancelled` at once and leaves its lane
(or its tenant's staging), so it stops counting against the queue bound; a running one gets the
flag its worker watches, and ends `cancelled` when the worker has aborted it."""

from __future__ import annotations

import time

from redis.asyncio import Redis

from sluice.broker.intake.calls import Cancel
from sluice.broker.keys import GROUP, ModelKeys
from sluice.broker.limits import AdmissionLimits
from sluice.broker.plumbing import Scripts


class Cancels:
    def __init__(self, redis: Redis, limits: AdmissionLimits) -> None:
        self.limits = limits
        self.scripts = Scripts(redis, pipelined=True)  # the cancels of one turn: one round trip

    async def cancel(self, model: str, rid: str) -> str | None:
        """The resulting state ('cancelled', 'cancelling', or the final one); None if unknown."""
        keys = ModelKeys(model)
        shard = keys.for_request(rid)  # its entry is on the shard's interactive stream, or on bulk
        return await self.scripts(Cancel(
            status=keys.status(rid), flag=keys.cancel(rid), reply=keys.reply(rid),
            interactive=shard.requests, bulk=shard.bulk, now=time.time(),
            cancel_ttl=self.limits.cancel_ttl_s, result_ttl=self.limits.result_ttl_s,
            reply_ttl=self.limits.reply_ttl_s, done_channel=shard.done, rid=rid, group=GROUP))
