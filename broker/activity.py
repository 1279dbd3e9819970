"""Bounded reads of a model's recent activity for the dashboard: samples of its inference log,
window by window, and the errors of a few failed requests.

The log's entry ids are the milliseconds at which workers appended them, so one XREVRANGE per
window finds its records without reading the rest of the log; each read takes at most
a bounded number of them (the newest), so a read costs the same at any throughput.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from sluice.broker.keys import ModelKeys
from sluice.protocol.messages import FinalResult


@dataclass
class LogWindow:
    """The records appended in [start, end) (seconds), newest first: all of them, or (`sampled`)
    only the newest ones, as many as a read takes."""

    start: float
    end: float
    records: list[tuple[float, dict[str, Any]]] = field(default_factory=list)  # (appended at, record)
    sampled: bool = False

    def since(self, t: float) -> LogWindow:
        """The part of this window from `t` on; sampled unless the read reached back before `t`."""
        return LogWindow(max(t, self.start), self.end, [r for r in self.records if r[0] >= t],
                         self.sampled and all(at >= t for at, _ in self.records))


@dataclass
class LogSample:
    first_at: float | None  # when the log's oldest record was appended (None: the log is empty)
    windows: list[LogWindow]  # in the order asked for


def _ms(entry_id: str) -> float:
    return int(entry_id.split("-", 1)[0]) / 1000


def _record(data: str | None) -> dict[str, Any]:
    try:
        record = json.loads(data or "")
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


async def sample_log(redis: Redis, model: str, windows: list[tuple[float, float, int]]) -> LogSample:
    """For each (start, end, cap): the newest `cap` records appended in [start, end) (seconds);
    and when the log begins. One round trip."""
    key = ModelKeys(model).log
    async with redis.pipeline(transaction=False) as pipe:
        pipe.xrange(key, count=1)
        for start, end, cap in windows:
            # ids are milliseconds: [start, end) is ms(start)-0 .. (ms(end)-1)-max
            pipe.xrevrange(key, max=str(int(end * 1000) - 1), min=str(int(start * 1000)), count=cap)
        first, *answers = await pipe.execute()
    found = [LogWindow(start, end, [(_ms(eid), _record(f.get("data"))) for eid, f in entries],
                       len(entries) >= cap)
             for (start, end, cap), entries in zip(windows, answers)]
    return LogSample(_ms(first[0][0]) if first else None, found)


async def errors_of(redis: Redis, model: str, request_ids: list[str]) -> dict[str, str | None]:
    """The error of each request's final result, while its status is kept (None once expired)."""
    keys = ModelKeys(model)
    async with redis.pipeline(transaction=False) as pipe:
        for rid in request_ids:
            pipe.hget(keys.status(rid), "result")
        results = await pipe.execute()
    out: dict[str, str | None] = {}
    for rid, raw in zip(request_ids, results):
        try:
            out[rid] = FinalResult.model_validate_json(raw).error if raw else None
        except ValueError:
            out[rid] = None
    return out
