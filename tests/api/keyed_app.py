"""An in-process api with API keys of both scopes, against the tests' private Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI

from sluice.config.settings import Settings
from tests.api.conftest import MODELS_YAML, running_app

ADMIN, ALICE, BOB = "admin-key", "alice-key", "bob-key"
KEYS = [f"admin:{ADMIN}", f"user:{ALICE}", BOB]  # a bare entry is a user key


@asynccontextmanager
async def keyed_app(settings: Settings, tmp_path: Path, keys: list[str] | None = None,
                    **updates: Any) -> AsyncIterator[FastAPI]:
    (tmp_path / "models.yaml").write_text(MODELS_YAML)
    async with running_app(settings.model_copy(update={
            "models_file": tmp_path / "models.yaml", "api_keys": KEYS if keys is None else keys, **updates})) as app:
        yield app


def client(app: FastAPI, key: str | None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://sluice", headers=headers)
