"""Throughput and latency per minute, from samples of a model's inference log (broker/activity.py).

Every api process reads the same log, so any replica answers the same. A window whose read was
capped is scaled up by how much of the window the sample spans (`sampled`: an estimate).
Latencies come from the timings the worker wrote into each record: end to end, queue wait and
time to first token, each from admission (as a client waits for them). A request its client
cancelled is counted apart: it is no failure (`failed` counts failed and expired ones).

`ActivityReader` keeps what a refresh costs small: a minute that is over cannot change, so each
api process reads it once; a refresh reads only the last 60 seconds (the current minute is part
of it), and viewers of one process share that read for `ttl_s`.
"""

from __future__ import annotations

import math
import time
from typing import Any

from redis.asyncio import Redis

from sluice.broker.activity import LogWindow, errors_of, sample_log

MAX_FAILURES = 10
NOT_FAILED = ("done", "cancelled")  # what the log records that is no failure: a cancel is the client's own
MIN_COVERED_S = 5.0
MINUTE_S = 60.0
CLOCK_SLACK_S = 5.0  # entry ids come from Redis's clock: a minute is over this long after its end


def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(math.ceil(p * len(ordered)) - 1, 0)]


def _r(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def _since(timings: dict[str, Any], mark: str) -> float | None:
    enqueued, at = timings.get("enqueued"), timings.get(mark)
    if isinstance(enqueued, int | float) and isinstance(at, int | float) and at >= enqueued:
        return at - enqueued
    return None


def _tokens(record: dict[str, Any]) -> int:
    output = record.get("output")
    n = output.get("num_output_tokens") if isinstance(output, dict) else None
    return n if isinstance(n, int) else 0


def window_stats(w: LogWindow, first_at: float | None) -> dict[str, Any]:
    """One window's counts, rates and latency percentiles. `data` is false for a window the log
    does not reach back to (trimmed, or before its first record): its values are unknown.
    `requests`, `failed` and `cancelled` count the part of the window the log covers (`partial`: not all)."""
    partial = first_at is not None and w.start < first_at < w.end
    out: dict[str, Any] = {"start": _r(w.start), "end": _r(w.end), "data": True, "partial": partial,
                           "sampled": w.sampled}
    if first_at is not None and first_at >= w.end and not w.records:
        percentiles = {f"{k}_{p}_s": None for k in ("e2e", "ttft", "queue") for p in ("p50", "p95")}
        return {**out, "data": False, "requests": None, "failed": None, "cancelled": None,
                "requests_per_s": None, "tokens_per_s": None, **percentiles}
    # The part of the window the log covers: all of it, or since its first record (the log was
    # trimmed, or began, inside the window; rates are over that part, a few seconds at least).
    seconds = w.end - w.start
    if first_at is not None and partial:
        seconds = max(w.end - first_at, min(MIN_COVERED_S, seconds))
    scale = 1.0
    if w.sampled:  # the newest `cap` records span only the end of the window
        oldest = min(at for at, _ in w.records)
        scale = seconds / max(w.end - oldest, 0.001)
    requests: dict[str, dict[str, Any]] = {}
    tokens = 0
    for i, (_, record) in enumerate(w.records):
        requests.setdefault(str(record.get("request_id") or f"#{i}"), record)  # rows of one request: once
        tokens += _tokens(record)
    done = [r for r in requests.values() if r.get("status") == "done"]
    cancelled = sum(r.get("status") == "cancelled" for r in requests.values())
    failed = len(requests) - len(done) - cancelled
    lat: dict[str, list[float]] = {"e2e": [], "ttft": [], "queue": []}
    for r in done:
        given = r.get("timings")
        timings = given if isinstance(given, dict) else {}
        for name, mark in (("e2e", "finished"), ("ttft", "first_token"), ("queue", "started")):
            value = _since(timings, mark)
            if value is not None:
                lat[name].append(value)
    return {**out, "requests": round(len(requests) * scale), "failed": round(failed * scale),
            "cancelled": round(cancelled * scale),
            "requests_per_s": _r(len(requests) * scale / seconds),
            "tokens_per_s": _r(tokens * scale / seconds, 1),
            **{f"{k}_{p}_s": _r(percentile(v, q)) for k, v in lat.items()
               for p, q in (("p50", 0.5), ("p95", 0.95))}}


def recent_failures(windows: list[LogWindow], limit: int = MAX_FAILURES) -> list[dict[str, Any]]:
    """The newest requests the log records as failed or expired (not done, nor cancelled by
    their client), newest first, from windows given newest first."""
    seen: dict[str, dict[str, Any]] = {}
    for w in windows:
        for at, record in w.records:
            rid = record.get("request_id")
            status = record.get("status")
            if not rid or status is None or status in NOT_FAILED or rid in seen:
                continue
            seen[str(rid)] = {"request_id": str(rid), "status": str(status), "at": _r(at), "error": None}
            if len(seen) >= limit:
                return list(seen.values())
    return list(seen.values())


class ActivityReader:
    """One per api process (see the module's doc): `read` answers a model's last minute, its
    last `minutes` minutes (oldest first, the current one so far last) and recent failures.
    A refresh reads at most `per_refresh` log records; a minute that is over, `per_minute`, once."""

    def __init__(self, redis: Redis, *, minutes: int = 10, per_refresh: int = 500, per_minute: int = 2000,
                 ttl_s: float = 1.0):
        self.redis = redis
        self.minutes = minutes
        self.per_refresh = per_refresh
        self.per_minute = per_minute
        self.ttl_s = ttl_s
        # (model, minute) -> that minute's stats and failures, once it is over
        self._over: dict[tuple[str, float], tuple[dict[str, Any], list[dict[str, Any]]]] = {}
        self._fresh: dict[str, tuple[float, dict[str, Any]]] = {}

    async def read(self, model: str, now: float | None = None) -> dict[str, Any]:
        hit = self._fresh.get(model)
        if hit and hit[0] > time.monotonic():
            return hit[1]
        now = time.time() if now is None else now
        current = math.floor(now / MINUTE_S) * MINUTE_S
        # The minutes over, oldest first.
        starts = [current - i * MINUTE_S for i in range(self.minutes - 1, 0, -1)]
        for key in [k for k in self._over if k[0] == model and k[1] < starts[0]]:
            del self._over[key]
        missing = [t for t in starts if (model, t) not in self._over]
        sample = await sample_log(self.redis, model, [(now - MINUTE_S, now, self.per_refresh),
                                                      *((t, t + MINUTE_S, self.per_minute) for t in missing)])
        last, *read = sample.windows
        past = {t: (window_stats(w, sample.first_at), recent_failures([w])) for t, w in zip(missing, read)}
        for t, found in past.items():
            if t + MINUTE_S + CLOCK_SLACK_S <= now:  # no record can be appended to it any more
                self._over[(model, t)] = found
        minutes = [past.get(t) or self._over[(model, t)] for t in starts]
        failures = _newest_first([recent_failures([last]), *(f for _, f in reversed(minutes))])
        errors = await errors_of(self.redis, model, [f["request_id"] for f in failures])
        answer = {"log_since": _r(sample.first_at), "last_minute": window_stats(last, sample.first_at),
                  "minutes": [*(stats for stats, _ in minutes),
                              window_stats(last.since(current), sample.first_at)],
                  "recent_failures": [{**f, "error": errors.get(f["request_id"])} for f in failures]}
        self._fresh[model] = (time.monotonic() + self.ttl_s, answer)
        return answer


def _newest_first(lists: list[list[dict[str, Any]]], limit: int = MAX_FAILURES) -> list[dict[str, Any]]:
    """Failure lists of windows newest first, as one, each request once."""
    seen: dict[str, dict[str, Any]] = {}
    for failures in lists:
        for f in failures:
            seen.setdefault(f["request_id"], f)
    return list(seen.values())[:limit]
