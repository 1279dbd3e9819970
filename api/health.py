"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from sluice.api.state import ApiState, state

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(s: ApiState = Depends(state)) -> JSONResponse:
    """Ready when Redis answers and every deployed model has a live worker."""
    try:
        await s.redis.ping()
        models = await s.models.all()
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


@router.get("/v1/workers", tags=["admin"])
async def workers(s: ApiState = Depends(state)) -> dict:
    live = await s.workers.live(s.settings.worker_ttl_s)
    return {"workers": [w.__dict__ for w in live]}
