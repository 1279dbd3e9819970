"""What keeps a model's Redis keys bounded beyond their TTLs: log records with a byte budget,
and consumers of dead workers removed from the group."""

from __future__ import annotations

import json
import logging
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from sluice.broker.keys import GROUP, ModelKeys
from sluice.broker.scripts import Scripts

log = logging.getLogger(__name__)


def _cap(value: Any, chars: int) -> Any:
    if isinstance(value, str):
        return value if len(value) <= chars else value[:chars] + "..."
    if isinstance(value, dict):
        return {k: _cap(v, chars) for k, v in value.items()}
    if isinstance(value, list):
        return [_cap(v, chars) for v in value]
    return value


def bounded_record(record: dict[str, Any], max_bytes: int) -> str:
    """The record as JSON in at most `max_bytes`: a record over it keeps the start of each of
    its strings (as many characters as fit) and says it was truncated. The log is capped by
    count too, so a model's log holds at most about count x max_bytes whatever its prompts."""
    data = json.dumps(record)
    if len(data) <= max_bytes:
        return data
    marked = {**record, "truncated": True}
    low, high = 0, max(len(data), 1)
    while low < high:  # the longest cap that fits
        mid = (low + high + 1) // 2
        if len(json.dumps(_cap(marked, mid))) <= max_bytes:
            low = mid
        else:
            high = mid - 1
    data = json.dumps(_cap(marked, low))
    if len(data) <= max_bytes:
        return data
    # Too many fields to fit at all: keep what identifies the row.
    return json.dumps({k: record[k] for k in ("request_id", "row", "status") if k in record} | {"truncated": True})


async def prune_consumers(redis: Redis, scripts: Scripts, keys: ModelKeys, streams: list[str]) -> list[str]:
    """Remove from the group the consumers whose worker is gone (its name's lock expired) and
    that hold nothing; one that still holds entries stays until they are reclaimed. Returns
    the names removed. The check and the removal are one script: a worker taking the name
    meanwhile would first take its lock."""
    names: set[str] = set()
    grouped = []
    for stream in streams:
        try:
            names.update(c["name"] for c in await redis.xinfo_consumers(stream, GROUP))
        except ResponseError:  # no stream or no group yet: nothing to prune there
            continue
        grouped.append(stream)
    removed = []
    for name in sorted(names):
        if await scripts.consumer_drop(keys=[keys.consumer_lock(name), *grouped], args=[GROUP, name]):
            removed.append(name)
    if removed:
        log.info("removed %d consumer(s) of dead workers from %s: %s", len(removed), keys.model, removed)
    return removed
