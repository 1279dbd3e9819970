"""Shared fixtures: a private redis-server on a free port (never the machine's own Redis)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from sluice.broker.connection import connect
from sluice.cli.processes import EmbeddedRedis
from sluice.config.settings import Settings

# One cache for every run on this machine: the default model is prepared once.
os.environ.setdefault("SLUICE_CACHE_DIR", str(Path.home() / ".cache" / "sluice"))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under xdist (`-n 2 --dist loadgroup`, the default), every test of the real engine runs in
    one worker process, so the session's one engine stack is started once."""
    for item in items:
        if item.get_closest_marker("engine") and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group("engine"))


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server: EmbeddedRedis) -> str:
    return redis_server.url


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    """A client on a clean database (each test starts from an empty Redis)."""
    client = connect(redis_url, name="sluice-test")
    await client.flushdb()
    yield client
    await client.aclose()


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> Settings:
    return Settings(redis_url=redis_url, data_dir=tmp_path / "data", lease_timeout_s=3.0,
                    heartbeat_interval_s=0.5, cancel_poll_s=0.05, shutdown_timeout_s=5.0)
