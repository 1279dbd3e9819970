"""Shared fixtures: a private redis-server on a free port (never the machine's own Redis)."""

from __future__ import annotations

import functools
import os
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from sluice.broker.plumbing.connection import connect
from sluice.config.settings import Settings
from sluice.supervisor.processes import EmbeddedRedis
from sluice.supervisor.topologies import LocalCluster

# One cache for every run on this machine: the default model is prepared once.
os.environ.setdefault("SLUICE_CACHE_DIR", str(Path.home() / ".cache" / "sluice"))


# xdist: `-n 3`. The tests of a module whose `pytestmark` names an `xdist_group` run in one
# process (the real-engine modules share one engine stack that way); every other test is
# scheduled on its own. xdist's own `--dist loadgroup` does not group under pytest 9 (the
# group suffix it adds to node ids is lost), hence this scheduler, keyed on the module source.
_GROUP = re.compile(r"^pytestmark\b.*xdist_group\(\s*(?:name=)?[\"']([\w-]+)[\"']", re.M)


@functools.cache
def _module_group(path: Path) -> str | None:
    try:
        found = _GROUP.search(path.read_text())
    except OSError:
        return None
    return found.group(1) if found else None


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _module_group(config.rootpath / nodeid.split("::", 1)[0]) or nodeid

    return ModuleGroups(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Grouped tests first (the engine stack is the longest path: it starts at once), and no
    real-engine test outside a group (it would start an engine stack of its own)."""
    loose = [i.nodeid for i in items if i.get_closest_marker("engine") and not i.get_closest_marker("xdist_group")]
    if loose:
        raise pytest.UsageError(f"engine tests without an xdist_group marker: {loose[:3]}")
    items.sort(key=lambda i: i.get_closest_marker("xdist_group") is None)


# SLUICE_TEST_REDIS=cluster runs the tests that use the shared server against a Redis Cluster
# of their own (3 primaries, 3 replicas) instead; tests that need one server (they restart or
# kill it) take `single_redis`.
TOPOLOGY = os.environ.get("SLUICE_TEST_REDIS", "single")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis | LocalCluster]:
    server = (LocalCluster(tmp_path_factory.mktemp("cluster")) if TOPOLOGY == "cluster"
              else EmbeddedRedis(tmp_path_factory.mktemp("redis")))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server: EmbeddedRedis | LocalCluster) -> str:
    return redis_server.url


@pytest.fixture(scope="session")
def jobs_broker_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str | None]:
    """Celery's broker: the shared server itself, or beside a cluster (Celery cannot use one) a
    single server of its own."""
    if TOPOLOGY != "cluster":
        yield None
        return
    server = EmbeddedRedis(tmp_path_factory.mktemp("jobs-broker")).start()
    yield server.url
    server.stop()


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    """A client on a clean database (each test starts from an empty Redis)."""
    client = connect(redis_url, name="sluice-test")
    await client.flushdb()
    yield client
    await client.aclose()


@pytest.fixture
def settings(redis_url: str, jobs_broker_url: str | None, tmp_path: Path) -> Settings:
    return Settings(redis_url=redis_url, jobs_broker_url=jobs_broker_url, data_dir=tmp_path / "data",
                    lease_timeout_s=3.0, heartbeat_interval_s=0.5, cancel_poll_s=0.05, shutdown_timeout_s=5.0)
