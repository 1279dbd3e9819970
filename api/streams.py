"""The cap on each api key's open SSE streams (README, "Security"), and on each tenant's
(its `max_streams`, across api processes: broker/intake/tenant_streams.py)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from starlette.types import Receive, Scope, Send

from sluice.api.auth import Caller
from sluice.api.errors import ApiError
from sluice.api.metrics import TENANT_REFUSED
from sluice.api.sse import EventStream
from sluice.broker.intake.tenant_streams import TenantStreams
from sluice.config.tenants import Tenants


class StreamSlots:
    """The SSE streams each api key holds open in this api process: at most `per_key`, a 429
    beyond (each open stream holds a connection, a reply reader and its buffers: 10,000 streams
    of one key grew the api 480 MB). Anonymous callers (no keys configured) are bounded by the
    connection cap alone."""

    def __init__(self, per_key: int, tenants: Tenants | None = None,
                 leases: TenantStreams | None = None) -> None:
        self.per_key = per_key
        self.open: Counter[str] = Counter()
        self.tenants, self.leases = tenants, leases

    async def reserve(self, caller: Caller | None) -> Slot:
        """A slot for one more stream of `caller` (None: no stream), or a 429: past the key's
        cap in this process, or its tenant's max_streams."""
        owner = caller.digest if caller else None
        if owner is not None and self.open[owner] >= self.per_key:
            raise ApiError(429, f"this key has {self.per_key} streams open, the most it may "
                                "(SLUICE_MAX_STREAMS_PER_KEY): close one first", code="too_many_streams",
                           headers={"Retry-After": "1"})
        slot = Slot(self, owner)
        limit = self.tenants.get(caller.tenant).max_streams if caller and self.tenants else None
        if limit and self.leases is not None:
            assert caller is not None
            try:
                lease = await self.leases.acquire(caller.tenant, limit)
            except BaseException:
                slot.release()
                raise
            if lease is None:
                slot.release()
                TENANT_REFUSED.labels(caller.tenant, "max_streams").inc()
                raise ApiError(429, f"tenant {caller.tenant!r} is over its max_streams limit ({limit}): "
                                    "close a stream first", code="rate_limit_exceeded",
                               headers={"Retry-After": "1"})
            slot.lease = (caller.tenant, lease)
        return slot


class Slot:
    def __init__(self, slots: StreamSlots, owner: str | None) -> None:
        self.slots, self.owner, self.held = slots, owner, owner is not None
        self.lease: tuple[str, str] | None = None  # (tenant, stream) of its tenant's lease
        if owner is not None:
            slots.open[owner] += 1

    def release(self) -> None:
        if self.lease is not None and self.slots.leases is not None:
            self.slots.leases.release(*self.lease)
            self.lease = None
        if self.held and self.owner is not None:
            self.held = False
            self.slots.open[self.owner] -= 1
            if not self.slots.open[self.owner]:
                del self.slots.open[self.owner]


class SlotStream(EventStream):
    """An SSE response that gives its slot back when it ends, however it ends."""

    def __init__(self, slot: Slot, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.slot = slot

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.slot.release()
