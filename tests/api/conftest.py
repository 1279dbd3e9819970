"""The api in-process: `create_app` with its lifespan run, an httpx client over ASGI, the test
session's private Redis, and (when a test asks for it) a null-engine worker in the same event
loop, so that a submitted request completes without a subprocess or a model."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from redis.asyncio import Redis

from sluice.api.app import create_app
from sluice.broker.plumbing.connection import connect
from sluice.config.model import load_models
from sluice.config.settings import Settings
from sluice.workers.engines.null import NullEngine
from sluice.workers.worker import Worker
from tests.broker.helpers import MODEL

MODELS_YAML = f"models:\n  - name: {MODEL}\n    continuous_batching_config: {{max_concurrent_batch_size: 4}}\n"
TOKEN_DELAY_S = 0.01  # one token at a time: deltas to stream, and a long request to cancel

StartApi = Callable[..., AbstractAsyncContextManager[FastAPI]]


@asynccontextmanager
async def running_app(settings: Settings) -> AsyncIterator[FastAPI]:
    """The app with its lifespan run: startup before the first request, shutdown after the last."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        yield app


def http_client(app: FastAPI, key: str | None = None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    # Unexpected exceptions come back as the app's 500 (as a server would answer), not raised.
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://test", headers=headers)


@pytest.fixture
def api_settings(settings: Settings, tmp_path: Path) -> Settings:
    (tmp_path / "models.yaml").write_text(MODELS_YAML)
    return settings.model_copy(update={"models_file": tmp_path / "models.yaml"})


@pytest.fixture
def start_api(redis: Redis, api_settings: Settings, tmp_path: Path) -> StartApi:
    """Another app than the default one: other settings, or another models file (`models_yaml`).
    Depends on `redis` so that its database is flushed before the app deploys into it."""

    def start(models_yaml: str | None = None, **updates: Any) -> AbstractAsyncContextManager[FastAPI]:
        if models_yaml is not None:
            (tmp_path / "other-models.yaml").write_text(models_yaml)
            updates = {"models_file": tmp_path / "other-models.yaml", **updates}
        return running_app(api_settings.model_copy(update=updates))

    return start


@pytest.fixture
async def app(start_api: StartApi) -> AsyncIterator[FastAPI]:
    async with start_api() as built:
        yield built


@pytest.fixture
async def api(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with http_client(app) as client:
        yield client


@pytest.fixture
async def null_worker(app: FastAPI, redis_url: str) -> AsyncIterator[Worker]:
    """A worker for the app's model with the null engine: " t0 t1 ..." one token per TOKEN_DELAY_S."""
    s: Settings = app.state.sluice.settings
    (model,) = [m for m in load_models(s.models_file) if m.name == MODEL]
    redis = connect(redis_url, name="sluice-api-test-worker")
    worker = Worker(s, model, NullEngine(token_delay_s=TOKEN_DELAY_S), redis, "api-test-worker")
    task = asyncio.create_task(worker.run(), name="api-test-worker")
    try:
        yield worker
    finally:
        worker.stopping.set()  # a flag, not a cancel: it drains and stops within its shutdown timeout
        await asyncio.wait_for(task, 30)
        await redis.aclose()
