"""What keeps a model's Redis keys bounded beyond their TTLs (log records with a byte budget,
consumers of dead workers removed from the group, entries past their deadline that no worker
started), and the cancel flags a worker polls."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from sluice.broker.delivery.fair_share import staged_streams
from sluice.broker.keys import GROUP, ModelKeys
from sluice.broker.plumbing import Scripts
from sluice.protocol.ids import request_shard

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


async def prune_consumers(redis: Redis, scripts: Scripts, keys: ModelKeys,
                          groups: list[tuple[ModelKeys, list[str]]]) -> list[str]:
    """Remove from the group the consumers whose worker is gone (its name's lock expired) and
    that hold nothing; one that still holds entries stays until they are reclaimed. Returns
    the names removed. `groups`: each shard's keys and streams (one slot each). The check and
    the removal are one script per shard: a worker taking the name meanwhile would first take
    its lock (shard 0's), and one that has fetched on a shard holds an entry there."""
    names: set[str] = set()
    present: list[tuple[ModelKeys, list[str]]] = []
    for shard, streams in groups:
        grouped = []
        for stream in streams:
            try:
                names.update(c["name"] for c in await redis.xinfo_consumers(stream, GROUP))
            except ResponseError:  # no stream or no group yet: nothing to prune there
                continue
            grouped.append(stream)
        if grouped:
            present.append((shard, grouped))
    removed = []
    for name in sorted(names):
        if len(present) > 1 and await redis.exists(keys.consumer_lock(name)):
            continue  # alive: spare the other shards' scripts (shard 0's checks the lock itself)
        dropped = [await scripts.consumer_drop(keys=[shard.consumer_lock(name), *streams], args=[GROUP, name])
                   for shard, streams in present]
        if all(dropped):
            removed.append(name)
    if removed:
        log.info("removed %d consumer(s) of dead workers from %s: %s", len(removed), keys.model, removed)
    return removed


def entry_deadline(fields: dict[str, str]) -> float | None:
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
    passed and that no worker started, or whose worker stopped renewing its lease: a model
    without a live worker would otherwise keep them queued until their status expired, and
    then answer 410 as if a result had existed (requests staged for their tenant's turn too).
    Each is decided by expire.lua, atomically
    against a worker starting it at the same moment. Returns the ids expired."""
    expired = []
    staged = [s for lane in streams for s in await staged_streams(redis, lane)]  # tenants' waiting turns
    for stream in [*streams, *staged]:
        start = "-"
        while True:
            entries = await redis.xrange(stream, min=start, count=page)
            for entry_id, fields in entries:
                deadline, rid = entry_deadline(fields), fields.get("id")
                if deadline is None or deadline >= now or not rid:
                    continue
                answer = await scripts.expire(
                    keys=[stream, keys.status(rid), keys.reply(rid)],
                    args=[GROUP, entry_id, now, deadline, int(lease_timeout_s * 1000), result_ttl_s,
                          reply_ttl_s, keys.for_request(rid).done, rid])
                if answer == "expired":
                    expired.append(rid)
            if len(entries) < page:
                break
            start = f"({entries[-1][0]}"
    if expired:
        log.info("expired %d request(s) of %s past their deadline that no worker started", len(expired),
                 keys.model)
    return expired


async def append_log(redis: Redis, key: str, records: list[dict], max_len: int, max_record_bytes: int) -> None:
    if not records:
        return
    async with redis.pipeline(transaction=False) as pipe:
        for record in records:
            pipe.xadd(key, {"data": bounded_record(record, max_record_bytes)}, maxlen=max_len, approximate=True)
        await pipe.execute()


class LogBuffer:
    """Inference-log records gathered across batches and written in one pipeline per `flush` (the
    worker flushes every 0.1 s): a round trip per batch cost a null-engine worker a tenth of its
    CPU. The log is for operators: a flush that fails (Redis away) logs and drops what it held,
    never a request's fault; at most `max_records` wait between flushes (the oldest go first)."""

    def __init__(self, write: Callable[[list[dict]], Awaitable[None]], max_records: int = 10_000) -> None:
        self._write, self.max_records = write, max_records
        self._records: list[dict] = []

    def add(self, records: list[dict]) -> None:
        self._records += records
        del self._records[:-self.max_records]

    async def flush(self) -> None:
        records, self._records = self._records, []
        try:
            await self._write(records)
        except Exception as err:
            log.warning("inference log write failed (%d record(s) dropped): %s", len(records), err)


async def cancel_flags(redis: Redis, keys: ModelKeys, rids: list[str]) -> set[str]:
    """Which of these requests have their cancel flag set: one MGET per shard (one slot each)."""
    by_shard: dict[int, list[str]] = {}
    for rid in rids:
        by_shard.setdefault(request_shard(rid), []).append(rid)
    out = set()
    for group in by_shard.values():
        flags = await redis.mget([keys.cancel(r) for r in group])
        out.update(r for r, f in zip(group, flags) if f is not None)
    return out


MAX_SHARDS = 64  # config/model.py's bound on `shards`


async def shards_in_use(redis: Redis, keys: ModelKeys, configured: int) -> int:
    """How many interactive shards a worker reads: the configured ones, and beyond them any
    shard a larger `shards` left entries on (so that lowering it drains the old shards)."""
    extra = [keys.at(k).requests for k in range(configured, MAX_SHARDS)]
    async with redis.pipeline(transaction=False) as pipe:
        for stream in extra:
            pipe.xlen(stream)
        lengths = await pipe.execute()
    used = [configured + i + 1 for i, n in enumerate(lengths) if n]
    return max([configured, *used])
