"""One page of a listing kept as a sorted set of ids (newest last), each id's value read from
its own key: only the page's keys are read, so a listing costs its page, not the whole set."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from sluice.broker.plumbing.decoded import members


async def newest_first(redis: Redis, index: str, after: str | None, limit: int,
                       read: Callable[[Pipeline, str], Any],
                       keep: Callable[[Any], bool] = bool) -> tuple[list[Any], list[str]]:
    """Up to `limit` values, newest first, from after the id `after` (from the top when the
    index does not hold it): `read(pipe, id)` queues the read of one id's value (one command
    a key, each its own slot on a cluster), `keep(value)` says whether it is listed. Also
    returns the ids whose value is gone (expired), for the caller to drop from the index."""
    rank = await redis.zrevrank(index, after) if after else None
    start = rank + 1 if isinstance(rank, int) else 0  # (a rank without its score: an int, or None)
    out: list[Any] = []
    gone: list[str] = []
    while len(out) < limit:
        ids = members(await redis.zrevrange(index, start, start + max(limit - len(out), 16) - 1))
        if not ids:
            break
        start += len(ids)
        async with redis.pipeline(transaction=False) as pipe:
            for item in ids:
                read(pipe, item)
            values = await pipe.execute()
        gone += [item for item, value in zip(ids, values) if not value]
        out += [value for value in values if value and keep(value)]
    return out[:limit], gone
