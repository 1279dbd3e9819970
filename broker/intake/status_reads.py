"""Reading a request's status: from its model, from whichever model holds it, or as the
replicas hold it (a final shown once a failover cannot take it back)."""

from __future__ import annotations

import dataclasses
import logging

from redis.asyncio import Redis

from sluice.broker.keys import ModelKeys
from sluice.broker.limits import AdmissionLimits
from sluice.broker.plumbing import has_replicas, hash_of, read_copied
from sluice.broker.status import RequestStatus
from sluice.protocol.states import State

log = logging.getLogger(__name__)


class StatusReads:
    """`limits`: wait_replicas (how many replicas a final shown must be on, see status_copied)
    and fsync_timeout_ms (how long its read waits for them)."""

    def __init__(self, redis: Redis, limits: AdmissionLimits) -> None:
        self.redis = redis
        self.limits = limits

    async def status(self, model: str, rid: str) -> RequestStatus | None:
        """The request's status; None when Redis holds none (unknown, or expired)."""
        raw = hash_of(await self.redis.hgetall(ModelKeys(model).status(rid)))
        return RequestStatus.from_hash(rid, model, raw)

    async def status_copied(self, model: str, rid: str) -> tuple[RequestStatus | None, bool]:
        """The status as the replicas hold it (wait_replicas), and whether a final was held back.
        A final read from the primary alone could be taken back by a failover (inside the
        commit's own WAIT) and the request run again: it is shown once a replica has it, or at
        once when the node has no replica (none could take over from it)."""
        key = ModelKeys(model).status(rid)
        raw, on_replicas = await read_copied(self.redis, key, self.limits.wait_replicas,
                                             self.limits.fsync_timeout_ms)
        status = RequestStatus.from_hash(rid, model, raw)
        if on_replicas or status is None or not status.final or not await has_replicas(self.redis, key):
            return status, False
        log.warning("the final of request %s is on its primary alone after %d ms: not shown yet", rid,
                    self.limits.fsync_timeout_ms)
        return dataclasses.replace(status, state=State.RUNNING, result=None), True

    async def find_status(self, rid: str, models: list[str]) -> RequestStatus | None:
        """The request's status, from whichever of `models` holds it (ids do not name their
        model; its `model` says which): one round trip for them all. None when none does."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for m in models:
                pipe.hgetall(ModelKeys(m).status(rid))
            found = await pipe.execute()
        return next((s for m, raw in zip(models, found) if (s := RequestStatus.from_hash(rid, m, raw))), None)
