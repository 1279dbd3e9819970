"""Fault tests on real processes: a private redis-server (AOF on), the api, null-engine workers.

Every test records a row (submitted, accepted, completed, duplicated, lost, recovery time)
printed as a table at the end of the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis as redis_sync

from sluice.broker import keys
from sluice.broker.keys import ModelKeys
from sluice.broker.plumbing.urls import sync_connect
from sluice.protocol.states import FINAL_STATES
from sluice.supervisor.processes import EmbeddedRedis, free_port
from sluice.supervisor.stack import LocalStack
from sluice.supervisor.topologies import LocalCluster
from tests.conftest import TOPOLOGY

MODEL = "echo"
KEYS = ModelKeys(MODEL)
FINALS = {s.value for s in FINAL_STATES}  # protocol/states.py
MODELS_YAML = f"""
models:
  - name: {MODEL}
    continuous_batching_config:
      max_concurrent_batch_size: 16
"""
ROWS: list[dict] = []


class Cluster:
    """A LocalStack whose api and workers a test starts, kills and restarts. `env` is the whole
    environment of the processes started from now on (a test may change it)."""

    def __init__(self, local: LocalStack, topology: LocalCluster | None = None) -> None:
        self.local = local
        self.tmp = local.data_dir
        self.topology = topology  # SLUICE_TEST_REDIS=cluster: a local Redis Cluster instead
        self.redis: EmbeddedRedis = local.redis  # type: ignore[assignment]
        self.env = local.child_env
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api: subprocess.Popen | None = None
        self.workers: dict[str, subprocess.Popen] = {}

    def start_api(self) -> None:
        self.local.start_api(self.port, **self.env)
        self.api = self.local.apis[self.port]

    def start_worker(self, name: str, model: str = MODEL, **env: str) -> subprocess.Popen:
        self.workers[name] = self.local.start_worker(model, name, engine="null", **{**self.env, **env})
        return self.workers[name]

    def wait_workers(self, n: int, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                live = httpx.get(f"{self.url}/v1/workers", timeout=2).json()["workers"]
                if len([w for w in live if w["state"] == "running"]) >= n:
                    return
            except (httpx.HTTPError, KeyError):
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{n} workers not live")

    def signal(self, name: str, sig: signal.Signals) -> None:
        self.workers[name].send_signal(sig)

    def restart_redis(self) -> float:
        """kill -9 Redis and start it again on the same port and data; returns the seconds it was down."""
        if self.topology is not None:
            pytest.skip("restarts the one Redis server (a cluster's failover: test_redis_cluster.py)")
        return self.local.restart_redis()

    def one_server(self) -> EmbeddedRedis:
        """The Redis server, for a test that stops it (not a cluster's node: see restart_redis)."""
        if self.topology is not None:
            pytest.skip("stops the one Redis server (a cluster's failover: test_redis_cluster.py)")
        return self.redis

    def sync(self) -> redis_sync.Redis:
        return sync_connect(self.local.redis_url or "")


@contextlib.contextmanager
def make_cluster(tmp_path: Path, models_yaml: str = MODELS_YAML, *, strict: bool = False,
                 **env: str) -> Iterator[Cluster]:
    """A private Redis (fsync on every write when `strict`) and an api; workers are started by the test."""
    env = {"SLUICE_LEASE_TIMEOUT_S": "2", "SLUICE_WORKER_TTL_S": "3", "SLUICE_HEARTBEAT_INTERVAL_S": "0.3",
           "SLUICE_CANCEL_POLL_S": "0.1", "SLUICE_SHUTDOWN_TIMEOUT_S": "30",
           "SLUICE_NULL_TOKEN_DELAY_S": "0.02", "SLUICE_LOG_LEVEL": "INFO",
           "SLUICE_DURABILITY": "strict" if strict else "default", **env}
    topology = LocalCluster(tmp_path / "redis-cluster").start() if TOPOLOGY == "cluster" else None
    if topology is not None:  # bulk jobs are not run here: their broker is never used
        env = {**env, "SLUICE_JOBS_BROKER_URL": "redis://127.0.0.1:1/0"}
    try:
        with LocalStack(tmp_path, models_yaml, strict=strict, env=env, output="inherit",
                        redis_url=topology.url if topology else None) as local:
            local.start_redis()
            c = Cluster(local, topology)
            c.start_api()
            local.wait_ready(60, probe="healthz")
            yield c
    finally:
        if topology is not None:
            topology.stop()


def _wait_api(c: Cluster) -> None:
    c.local.wait_ready(60, probe="healthz")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with make_cluster(tmp_path) as c:
        yield c


def queued(r: redis_sync.Redis, stream: str) -> int:
    """Entries queued on a lane: on its stream and staged for their tenant's turn (fair share)."""
    return r.xlen(stream) + sum(r.xlen(keys.staged(stream, t)) for t in r.zrange(keys.backlog(stream), 0, -1))


def audit(c: Cluster, rids: list[str]) -> dict[str, int]:
    return audit_on(c.sync(), rids)


def audit_on(r: redis_sync.Redis, rids: list[str]) -> dict[str, int]:
    """Completed, duplicated (more than one final event) and lost (no final state) requests."""
    done = duplicated = lost = 0
    for rid in rids:
        finals = [f for _, f in r.xrange(KEYS.reply(rid)) if f.get("kind") == "final"]
        state = r.hget(KEYS.status(rid), "state")
        done += state == "done"
        duplicated += len(finals) > 1
        lost += state not in FINALS or not finals
    return {"completed": done, "duplicated": duplicated, "lost": lost}


def wait_final(c: Cluster, rids: list[str], timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    r = c.sync()
    pending = set(rids)
    while pending and time.monotonic() < deadline:
        pending = {rid for rid in pending
                   if r.hget(KEYS.status(rid), "state") not in FINALS}
        time.sleep(0.1)


def crash_until_final(c: Cluster, rid: str, worker: str = "a", timeout_s: float = 120, **env: str) -> int:
    """Restart `worker` each time it dies (as a process manager would) until `rid` is final;
    returns how many times it crashed."""
    r = c.sync()
    started, crashes = time.monotonic(), 0
    while r.hget(KEYS.status(rid), "state") not in ("failed", "done"):
        assert time.monotonic() - started < timeout_s, f"{rid} not final after {crashes} crashes"
        if c.workers[worker].poll() is not None:
            crashes += 1
            c.start_worker(worker, **env)
        time.sleep(0.1)
    return crashes


def record(fault: str, submitted: int, accepted: int, figures: dict[str, int], recovery_s: float | None) -> None:
    ROWS.append({"fault": fault, "submitted": submitted, "accepted": accepted, **figures,
                 "recovery_s": None if recovery_s is None else round(recovery_s, 2)})


def pytest_terminal_summary(terminalreporter) -> None:
    if not ROWS:
        return
    tr = terminalreporter
    tr.section("fault table")
    cols = ["fault", "submitted", "accepted", "completed", "duplicated", "lost", "recovery_s"]
    tr.write_line(" | ".join(cols))
    for row in ROWS:
        tr.write_line(" | ".join(str(row.get(k)) for k in cols))
    out = os.environ.get("SLUICE_FAULT_REPORT")
    if out:
        Path(out).write_text(json.dumps(ROWS, indent=2))
