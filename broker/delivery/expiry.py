"""Requests past their deadline that no worker started end `expired` (lua/expire.lua): a model
without a live worker would otherwise keep them queued until their status expired, and then
answer 410 as if a result had existed. The api's sweep (api/expiry.py) runs this."""

from __future__ import annotations

import json
import logging

from redis.asyncio import Redis

from sluice.broker.delivery.calls import Expire
from sluice.broker.delivery.fair_share import staged_streams
from sluice.broker.keys import GROUP, ModelKeys
from sluice.broker.plumbing import Fields, Scripts, stream_entries

log = logging.getLogger(__name__)


def entry_deadline(fields: Fields) -> float | None:
    """The deadline of a stream entry (its message's), or None when it cannot be read (a
    worker dead-letters such an entry; the sweep leaves it alone)."""
    try:
        deadline = json.loads(fields["data"])["deadline"]
    except (KeyError, TypeError, ValueError):
        return None
    return float(deadline) if isinstance(deadline, int | float) else None


async def expire_overdue(redis: Redis, scripts: Scripts, keys: ModelKeys, streams: list[str], *, now: float,
                         lease_timeout_s: float, result_ttl_s: int, reply_ttl_s: int,
                         page: int = 200) -> list[str]:
    """End `expired` every request on these streams (one shard's: one slot) whose deadline has
    passed and that no worker started, or whose worker stopped renewing its lease (requests
    staged for their tenant's turn too). Each is decided by expire.lua, atomically against a
    worker starting it at the same moment. Returns the ids expired."""
    expired = []
    staged = [s for lane in streams for s in await staged_streams(redis, lane)]  # tenants' waiting turns
    for stream in [*streams, *staged]:
        start = "-"
        while True:
            page_entries = stream_entries(await redis.xrange(stream, min=start, count=page))
            for entry_id, fields in page_entries:
                deadline, rid = entry_deadline(fields), fields.get("id")
                if deadline is None or deadline >= now or not rid:
                    continue
                answer = await scripts(Expire(
                    stream=stream, status=keys.status(rid), reply=keys.reply(rid), group=GROUP,
                    entry_id=entry_id, now=now, deadline=deadline, lease_ms=int(lease_timeout_s * 1000),
                    result_ttl=result_ttl_s, reply_ttl=reply_ttl_s, channel=keys.for_request(rid).done,
                    rid=rid))
                if answer == "expired":
                    expired.append(rid)
            if len(page_entries) < page:
                break
            start = f"({page_entries[-1][0]}"
    if expired:
        log.info("expired %d request(s) of %s past their deadline that no worker started", len(expired),
                 keys.model)
    return expired
