"""The operator's live page: `GET /dashboard` (a static page, no key) polls `GET /v1/dashboard`
(admin only when keys are set: it shows every caller's failures, host names and pids).

Everything comes from Redis, so every api replica shows the same: per model its queues (waiting
and running apart, broker/intake/queues.py), live workers, throughput and latency minute by minute
(api/activity.py), recent failures (a client's own cancel is none) and dead letters; the
bulk jobs being run; the tenants (their configuration, entries queued per model, open streams
and stored files); and the webhook deliveries. Each read is bounded, whatever the traffic (the inference
log is read in samples, see api/activity.py).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import re
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse

from sluice.api.activity import ActivityReader
from sluice.api.auth import require_admin
from sluice.api.state import ApiState, state
from sluice.broker.delivery.dead_letters import DeadLetters
from sluice.broker.intake.queues import queue_figures
from sluice.broker.intake.tenant_queued import queued_by_tenant
from sluice.broker.keys import tenant_streams
from sluice.broker.registry import WorkerInfo
from sluice.broker.webhooks.deliveries import OUTCOME_MINUTES, Deliveries
from sluice.broker.webhooks.outbox import DEAD, ENDPOINTS
from sluice.config.model import ModelConfig

router = APIRouter(tags=["dashboard"])

MINUTES = 10  # throughput and latency minute by minute, this many
DEAD_LETTERS_SHOWN = 5
BATCHES_SHOWN = 20

PAGE = Path(__file__).with_name("dashboard.html").read_text(encoding="utf-8")


def _csp(page: str) -> str:
    """Only the page's own inline script and style run; it talks to its own origin only."""
    def hashes(tag: str) -> str:
        found = re.findall(rf"<{tag}>(.*?)</{tag}>", page, re.S)
        digests = (base64.b64encode(hashlib.sha256(s.encode()).digest()).decode() for s in found)
        return " ".join(f"'sha256-{digest}'" for digest in digests)
    return (f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; "
            "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


HEADERS = {"Content-Security-Policy": _csp(PAGE), "X-Content-Type-Options": "nosniff",
           "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


@router.get("/dashboard", include_in_schema=False)
async def page() -> HTMLResponse:
    return HTMLResponse(PAGE, headers=HEADERS)


def _worker(w: WorkerInfo, now: float) -> dict[str, Any]:
    return {"name": w.name, "model": w.model, "version": w.version, "mode": w.mode, "state": w.state,
            "host": w.host, "pid": w.pid, "in_flight": w.in_flight, "capacity": w.capacity,
            "heartbeat_age_s": round(max(now - w.heartbeat_at, 0.0), 1),
            "uptime_s": round(max(now - w.started_at, 0.0), 1), "metrics_url": w.metrics_url,
            "prefix_cache": _prefix_cache(w)}


def _prefix_cache(w: WorkerInfo) -> dict[str, Any] | None:
    """The worker's engine's prefix-cache counters since it started (prompt tokens), and their
    hit rate; None when its engine has no prefix cache (or it is older than the counters)."""
    if w.prefix_cache_queries is None or w.prefix_cache_hits is None:
        return None
    rate = round(w.prefix_cache_hits / w.prefix_cache_queries, 4) if w.prefix_cache_queries else None
    return {"queries": w.prefix_cache_queries, "hits": w.prefix_cache_hits, "hit_rate": rate,
            "blocks": w.prefix_cache_blocks, "block_size": w.prefix_cache_block_size}


def _reader(request: Request, s: ApiState) -> ActivityReader:
    """The api process's reader: its cache of minutes that are over is shared by every viewer."""
    reader: ActivityReader | None = getattr(request.app.state, "dashboard_activity", None)
    if reader is None:
        reader = request.app.state.dashboard_activity = ActivityReader(s.redis, minutes=MINUTES)
    return reader


async def _model(request: Request, s: ApiState, m: ModelConfig, live: list[WorkerInfo],
                 now: float) -> dict[str, Any]:
    letters = DeadLetters(s.redis, m.name, shards=m.shards)
    queue, (dead, newest), found = await asyncio.gather(
        queue_figures(s.redis, m.name, m.shards), letters.recent(DEAD_LETTERS_SHOWN),
        _reader(request, s).read(m.name, now))
    mine = [w for w in live if w.model == m.name]
    return {
        "name": m.name, "version": m.version, "mode": m.mode.value, "prefix_affinity": m.prefix_affinity,
        "max_queued": m.max_queued or s.settings.max_queued,
        "queue": {lane: figures.view() for lane, figures in queue.items()},
        "in_flight": sum(w.in_flight for w in mine), "capacity": sum(w.capacity for w in mine),
        "workers": [_worker(w, now) for w in mine],
        "activity": {k: v for k, v in found.items() if k != "recent_failures"},
        "recent_failures": found["recent_failures"],
        "dead_letters": {"count": dead, "recent": [
            {"request_id": d.request_id, "error": d.error[:500], "attempts": d.attempts,
             "failed_at": d.failed_at, "lane": "bulk" if d.stream == letters.keys.bulk else "interactive"}
            for d in newest]},
    }


def _batch(b: dict[str, Any]) -> dict[str, Any]:
    counts = b["request_counts"]
    done = counts["completed"] + counts["failed"]
    return {"id": b["id"], "status": b["status"], "endpoint": b["endpoint"], "created_at": b["created_at"],
            "request_counts": counts, "output_tokens": b["usage"]["output_tokens"],
            "progress": round(done / counts["total"], 4) if counts["total"] else None}


@router.get("/v1/dashboard", tags=["admin"], dependencies=[Depends(require_admin)])
async def dashboard(request: Request, s: ApiState = Depends(state)) -> dict[str, Any]:
    """Everything the dashboard page shows, read from Redis (the same from every api replica)."""
    now = time.time()
    deployed, live, batches = await asyncio.gather(
        s.deployments.all(fresh=True), s.workers.live(s.settings.worker_ttl_s), s.jobs.active(BATCHES_SHOWN))
    models = await asyncio.gather(*(_model(request, s, m, live, now) for m in deployed.values()))
    return {
        "generated_at": round(now, 3), "minutes": MINUTES,
        "models": list(models),
        "other_workers": [_worker(w, now) for w in live if w.model not in deployed],
        "batches": [_batch(b) for b in batches],
        "webhooks": await _webhooks(s),
        "tenants": await _tenants(s, list(deployed.values())),
    }


TENANTS_SHOWN = 100  # a keys file names its tenants: more than this is not a page's table


async def _tenants(s: ApiState, models: list[ModelConfig]) -> list[dict[str, Any]]:
    """Each configured tenant (and `default`): its weight, queue share and limits, the entries it
    holds queued per model (fair share's `<tag>:held`, docs/protocol.md), its open streams (live
    leases) and stored files. A bounded read: a field per tenant and model shard, a set and a hash."""
    names = s.tenants.names()[:TENANTS_SHOWN]
    now_ms = time.time() * 1000
    async with s.redis.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.zcount(tenant_streams(name), now_ms, "+inf")
        streams = await pipe.execute()
    queued, files = await asyncio.gather(
        queued_by_tenant(s.redis, [(m.name, m.shards) for m in models], names),
        asyncio.gather(*(s.files.tenant_files.usage(name) for name in names)))
    return [{"name": name, **s.tenants.get(name).model_dump(), "queued": queued[name], "streams": int(open_),
             "files": stored, "file_bytes": stored_bytes}
            for name, open_, (stored, stored_bytes) in zip(names, streams, files)]


async def _webhooks(s: ApiState) -> dict[str, Any]:
    """Webhook deliveries (docs/webhooks.md): settled over the last minutes by outcome, the backlog
    (first attempts in flight and retries waiting), its oldest event's age, the dead-lettered."""
    deliveries = Deliveries(s.redis)
    (backlog, oldest), outcomes, dead, endpoints = await asyncio.gather(
        deliveries.backlog(), deliveries.outcomes(), s.redis.llen(DEAD), s.redis.hlen(ENDPOINTS))
    return {"endpoints": endpoints, "minutes": OUTCOME_MINUTES, "outcomes": outcomes, "backlog": backlog,
            "oldest_pending_s": round(oldest, 1), "dead": dead}
