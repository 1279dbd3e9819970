"""Liveness, readiness, live workers and metrics."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from sluice.api.auth import require_admin
from sluice.api.metrics import OLDEST_AGE, QUEUE_DEPTH, QUEUE_RUNNING, TENANT_QUEUED, exposition
from sluice.api.state import ApiState, state
from sluice.broker.intake.queues import queue_figures
from sluice.broker.intake.tenant_queued import queued_by_tenant

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(s: ApiState = Depends(state)) -> JSONResponse:
    """Ready when Redis answers and every deployed model has a live worker."""
    try:
        await s.redis.ping()
        models = list((await s.deployments.all(fresh=True)).values())
        live = await s.workers.live(s.settings.worker_ttl_s)
    except Exception as err:
        return JSONResponse({"status": "unavailable", "redis": f"{type(err).__name__}: {err}"}, 503)
    served = {w.model for w in live}
    missing = [m.name for m in models if m.name not in served]
    body = {
        "status": "ready" if models and not missing else "not ready",
        "models": {m.name: sum(w.model == m.name for w in live) for m in models},
        "missing_workers": missing,
    }
    return JSONResponse(body, 200 if models and not missing else 503)


@router.get("/v1/workers", tags=["admin"], dependencies=[Depends(require_admin)])
async def workers(s: ApiState = Depends(state)) -> dict:
    """Live workers with their host names and pids: admin only when keys are set."""
    live = await s.workers.live(s.settings.worker_ttl_s)
    return {"workers": [w.__dict__ for w in live]}


@router.get("/metrics", include_in_schema=False)
async def metrics(s: ApiState = Depends(state)) -> Response:
    """Prometheus text format; the queue gauges are read from Redis at each scrape."""
    deployed = list((await s.deployments.all(fresh=True)).values())
    for m in deployed:
        for lane, figures in (await queue_figures(s.redis, m.name, m.shards)).items():
            QUEUE_DEPTH.labels(m.name, lane).set(figures.waiting)
            QUEUE_RUNNING.labels(m.name, lane).set(figures.running)
            OLDEST_AGE.labels(m.name, lane).set(figures.oldest_waiting_s)
    queued = await queued_by_tenant(s.redis, [(m.name, m.shards) for m in deployed], s.tenants.names())
    for tenant, per_model in queued.items():
        for model, held in per_model.items():
            TENANT_QUEUED.labels(tenant, model).set(held)
    body, media_type = exposition()
    return Response(body, media_type=media_type)
