"""The SSE streams each tenant holds open across every api process, for its `max_streams`.

One sorted set per tenant (keys.tenant_streams): each open stream is a member scored with its
lease's expiry. The api that serves a stream refreshes the leases of all its streams every
third of a lease, and removes a stream as it closes; a stream of an api that was killed leaves
the count when its lease expires, so nothing leaks. The set itself expires with its last lease.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import defaultdict

from redis.asyncio import Redis

from sluice.broker.intake.calls import TenantStream
from sluice.broker.keys import tenant_streams
from sluice.broker.plumbing import Scripts

log = logging.getLogger(__name__)


class TenantStreams:
    def __init__(self, redis: Redis, *, lease_s: float = 30.0) -> None:
        self.redis = redis
        self.lease_ms = int(lease_s * 1000)
        self.scripts = Scripts(redis)
        self._process = uuid.uuid4().hex[:12]  # this api process: its streams' members start with it
        self._count = 0
        self.open: dict[str, set[str]] = defaultdict(set)  # tenant → members this process holds
        self._removals: set[asyncio.Task] = set()
        self._stopping = asyncio.Event()

    async def acquire(self, tenant: str, limit: int) -> str | None:
        """A lease on one more open stream of `tenant` (its member), or None at `limit`."""
        self._count += 1
        member = f"{self._process}:{self._count}"
        if not await self._lease(tenant, limit, (member,)):
            return None
        self.open[tenant].add(member)
        return member

    def release(self, tenant: str, member: str) -> None:
        """The stream closed: its lease goes (in the background; if that fails, it expires)."""
        self.open[tenant].discard(member)
        if not self.open[tenant]:
            del self.open[tenant]
        task = asyncio.ensure_future(self._remove(tenant, member))
        self._removals.add(task)
        task.add_done_callback(self._removals.discard)

    async def _remove(self, tenant: str, member: str) -> None:
        try:
            await self.redis.zrem(tenant_streams(tenant), member)
        except Exception as err:  # noqa: BLE001 - the lease expires instead
            log.warning("could not end the lease of a stream of tenant %r (%s); it expires", tenant, err)

    async def refresh(self) -> None:
        """Extend the leases of every stream this process holds open."""
        await asyncio.gather(*(self._lease(tenant, 0, tuple(members))
                               for tenant, members in list(self.open.items()) if members))

    async def _lease(self, tenant: str, limit: int, streams: tuple[str, ...]) -> bool:
        """Take a lease on `streams` (one, under `limit`), or refresh theirs (`limit` 0)."""
        return bool(await self.scripts(TenantStream(key=tenant_streams(tenant), lease_ms=self.lease_ms,
                                                    limit=limit, streams=streams)))

    async def run(self) -> None:
        """Refresh every third of a lease until stopped."""
        while not self._stopping.is_set():
            try:
                await self.refresh()
            except Exception as err:  # noqa: BLE001 - tried again next time, within the lease
                log.warning("could not refresh the tenants' stream leases (%s)", err)
            try:
                await asyncio.wait_for(self._stopping.wait(), self.lease_ms / 3000)
            except TimeoutError:
                pass

    def stop(self) -> None:
        self._stopping.set()
