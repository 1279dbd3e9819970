"""The FastAPI application: stateless, everything it knows lives in Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI

from sluice.api import batches, dashboard, errors, health, requests, responses, tokenize, webhooks
from sluice.api import models as model_routes
from sluice.api import openai as openai_routes
from sluice.api.auth import KeyBeforeBody, load_keys, require_key
from sluice.api.limits import BodySizeLimit
from sluice.api.state import build_state
from sluice.api.tenant_limits import RateLimitHeaders
from sluice.config.model import load_models
from sluice.config.runtime import freeze_gc_heap
from sluice.config.settings import Settings
from sluice.protocol import structured


def app_from_environment() -> FastAPI:
    """The app of one of several api processes (`sluice api --workers N`): settings from SLUICE_*."""
    return create_app(Settings(), freeze_gc=True)


def create_app(settings: Settings | None = None, *, freeze_gc: bool = False) -> FastAPI:
    """The api. `freeze_gc`: the process is the api's own, and its start-up heap is frozen once
    the start is done (config/runtime.py)."""
    settings = settings or Settings()
    models = load_models(settings.models_file)
    _, tenants = load_keys(settings)  # a bad keys file stops the start here, with its message

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # xgrammar's first import takes seconds (5 s of CPU here): done in a thread, beside the
        # rest of the start, and finished before the api answers anything, as the tokenizers
        # are: no request's event loop waits for it, and no module is imported by a thread
        # while requests run (an import beside code walking a dict it adds to, such as
        # sys.modules, raised 'dictionary changed size during iteration' in a test once)
        app.state.structured_backend = asyncio.create_task(asyncio.to_thread(structured.backend))
        app.state.sluice = build_state(settings, models)
        await app.state.sluice.open()
        await app.state.structured_backend
        if freeze_gc:
            freeze_gc_heap()
        try:
            yield
        finally:
            await app.state.sluice.close()

    # No trailing-slash redirect: Starlette's built its Location from the Host header, so
    # `GET /v1/requests/` with `Host: evil.example` answered 307 to http://evil.example/...
    app = FastAPI(title="Sluice", version="0.1.0", lifespan=lifespan, redirect_slashes=False)
    app.state.tenants = tenants  # the tenants registry: get(name) → weight, queue_share, limits
    app.add_middleware(RateLimitHeaders)  # a tenant's x-ratelimit-* headers on a submitting route's answers
    # Inside BodySizeLimit: a body over the limit is refused by its length first.
    app.add_middleware(KeyBeforeBody)
    # /tokenize's body holds one prompt of at most max_prompt_chars: a larger one is refused from its headers
    tokenize_cap = min(settings.max_body_bytes, tokenize.max_body_bytes(settings.max_prompt_chars))
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes,
                       overrides={"/v1/files": settings.max_file_bytes, "/tokenize": tokenize_cap})
    errors.install(app)
    app.include_router(health.router)
    app.include_router(dashboard.router)  # the page needs no key; its data route is admin only
    protected = [Depends(require_key)]
    app.include_router(requests.router, dependencies=protected)
    app.include_router(model_routes.router, dependencies=protected)
    app.include_router(openai_routes.router, dependencies=protected)
    app.include_router(responses.router, dependencies=protected)
    app.include_router(tokenize.router, dependencies=protected)
    app.include_router(batches.router, dependencies=protected)
    app.include_router(webhooks.router, dependencies=protected)  # admin keys only
    return app
