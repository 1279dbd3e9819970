"""A model's inference log (one record per row run, for operators): written by its workers in
batched order, kept bounded beyond any TTL (capped in records, approximate MAXLEN, and each
record in bytes), and read by the api's admin route."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from redis.asyncio import Redis

from sluice.broker.keys import ModelKeys
from sluice.broker.plumbing import stream_entries

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
    kept = {k: record[k] for k in ("request_id", "row", "status") if k in record}
    return json.dumps(kept | {"truncated": True})


class InferenceLog:
    """The log stream `key`, written in batched order: at most about `max_len` records of at
    most `max_record_bytes` each."""

    def __init__(self, redis: Redis, key: str, max_len: int, max_record_bytes: int) -> None:
        self.redis, self.key = redis, key
        self.max_len, self.max_record_bytes = max_len, max_record_bytes

    async def append(self, records: list[dict[str, Any]]) -> None:
        if not records:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for record in records:
                pipe.xadd(self.key, {"data": bounded_record(record, self.max_record_bytes)},
                          maxlen=self.max_len, approximate=True)
            await pipe.execute()


class LogBuffer:
    """Inference-log records gathered across batches and written in one pipeline per `flush` (the
    worker flushes every 0.1 s): a round trip per batch cost a null-engine worker a tenth of its
    CPU. The log is for operators: a flush that fails (Redis away) logs and drops what it held,
    never a request's fault; at most `max_records` wait between flushes (the oldest go first)."""

    def __init__(self, write: Callable[[list[dict[str, Any]]], Awaitable[None]],
                 max_records: int = 10_000) -> None:
        self._write, self.max_records = write, max_records
        self._records: list[dict[str, Any]] = []

    def add(self, records: list[dict[str, Any]]) -> None:
        self._records += records
        del self._records[:-self.max_records]

    async def flush(self) -> None:
        records, self._records = self._records, []
        try:
            await self._write(records)
        except Exception as err:
            log.warning("inference log write failed (%d record(s) dropped): %s", len(records), err)


class LogReads:
    """The admin's view of what ran."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis

    async def newest(self, model: str, limit: int) -> list[dict[str, Any]]:
        """The newest `limit` records of the model's log, oldest first."""
        found = stream_entries(await self.redis.xrevrange(ModelKeys(model).log, count=limit))
        return [json.loads(fields["data"]) for _, fields in reversed(found)]
