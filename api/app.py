"""The FastAPI application: stateless, everything it knows lives in Redis."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from celery import Celery
from fastapi import Depends, FastAPI

from sluice.api import batches, errors, health, requests
from sluice.api import models as model_routes
from sluice.api import openai as openai_routes
from sluice.api.auth import key_digests, require_key
from sluice.api.limits import BodySizeLimit
from sluice.api.state import ApiState, finish_cancels
from sluice.api.tokens import PromptLimits
from sluice.broker.admission import Admission
from sluice.broker.batches import BatchStore
from sluice.broker.connection import connect
from sluice.broker.files import FileStore
from sluice.broker.notifications import DoneListener
from sluice.broker.registry import ModelRegistry, WorkerRegistry
from sluice.config.model import load_models
from sluice.config.settings import Settings

log = logging.getLogger(__name__)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    models = load_models(settings.models_file)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        redis = connect(settings.redis_url, name="sluice-api")
        registry = ModelRegistry(redis)
        try:
            for m in models:  # a deployment changed at run time is kept
                await registry.deploy(m, keep_existing=True)
        except Exception as err:
            log.warning("could not register models in Redis yet (%s); continuing", err)
        app.state.sluice = ApiState(
            settings=settings,
            redis=redis,
            admission=Admission(redis, status_ttl_s=settings.status_ttl_s,
                                reply_ttl_s=settings.reply_ttl_s, cancel_ttl_s=settings.cancel_ttl_s,
                                result_ttl_s=settings.result_ttl_s, bulk_queue_share=settings.bulk_queue_share,
                                strict=settings.durability == "strict"),
            models=registry,
            workers=WorkerRegistry(redis),
            default_model=models[0].name if models else None,
            configured={m.name: m for m in models},
            done=DoneListener(redis),
            key_digests=key_digests(settings.api_keys),
            prompt_limits=PromptLimits(settings.cache_dir),
            files=FileStore(redis, settings.files_path, settings.max_file_bytes, settings.file_ttl_s),
            batches=BatchStore(redis, settings.batch_ttl_s, settings.result_ttl_s),
            celery=Celery("sluice", broker=settings.redis_url),
        )
        app.state.sluice.done.start()
        yield
        await finish_cancels()
        await app.state.sluice.done.close()
        await redis.aclose()

    app = FastAPI(title="Sluice", version="0.1.0", lifespan=lifespan)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes,
                       overrides={"/v1/files": settings.max_file_bytes})
    errors.install(app)
    app.include_router(health.router)
    protected = [Depends(require_key)]
    app.include_router(requests.router, dependencies=protected)
    app.include_router(model_routes.router, dependencies=protected)
    app.include_router(openai_routes.router, dependencies=protected)
    app.include_router(batches.router, dependencies=protected)
    return app
