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
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis as redis_sync

from sluice.broker.embedded import EmbeddedRedis, free_port
from sluice.broker.keys import ModelKeys
from sluice.cli.processes import stop_processes

MODEL = "echo"
KEYS = ModelKeys(MODEL)
MODELS_YAML = f"""
models:
  - name: {MODEL}
    continuous_batching_config:
      max_concurrent_batch_size: 16
"""
ROWS: list[dict] = []


@dataclass
class Cluster:
    tmp: Path
    redis: EmbeddedRedis
    env: dict[str, str]
    url: str
    api: subprocess.Popen | None = None
    workers: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start_api(self) -> None:
        port = int(self.url.rsplit(":", 1)[1])
        self.api = subprocess.Popen([sys.executable, "-m", "sluice.cli", "api", "--port", str(port)],
                                    env=self.env)

    def start_worker(self, name: str, model: str = MODEL, **env: str) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sluice.cli", "worker", "--model", model, "--engine", "null", "--name", name],
            env={**self.env, **env},
        )
        self.workers[name] = proc
        return proc

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
        t0 = time.monotonic()
        self.redis.stop(kill=True)
        self.redis.start()
        return time.monotonic() - t0

    def sync(self) -> redis_sync.Redis:
        return redis_sync.Redis.from_url(self.redis.url, decode_responses=True)


@contextlib.contextmanager
def make_cluster(tmp_path: Path, models_yaml: str = MODELS_YAML, *, strict: bool = False,
                 **env: str) -> Iterator[Cluster]:
    """A private Redis (fsync on every write when `strict`) and an api; workers are started by the test."""
    models = tmp_path / "models.yaml"
    models.write_text(models_yaml)
    redis = EmbeddedRedis(tmp_path / "redis", strict=strict).start()
    env = {**os.environ, "SLUICE_REDIS_URL": redis.url, "SLUICE_MODELS_FILE": str(models),
           "SLUICE_LEASE_TIMEOUT_S": "2", "SLUICE_WORKER_TTL_S": "3", "SLUICE_HEARTBEAT_INTERVAL_S": "0.3",
           "SLUICE_CANCEL_POLL_S": "0.1", "SLUICE_SHUTDOWN_TIMEOUT_S": "30",
           "SLUICE_NULL_TOKEN_DELAY_S": "0.02", "SLUICE_LOG_LEVEL": "INFO",
           "SLUICE_DURABILITY": "strict" if strict else "default", **env}
    c = Cluster(tmp_path, redis, env, f"http://127.0.0.1:{free_port()}")
    c.start_api()
    try:
        _wait_api(c)
        yield c
    finally:
        stop_processes([*c.workers.values(), *([c.api] if c.api else [])], timeout_s=30)
        redis.stop()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with make_cluster(tmp_path) as c:
        yield c


def _wait_api(c: Cluster) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert c.api is not None and c.api.poll() is None, "the api exited"
        try:
            if httpx.get(f"{c.url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError("api")


def audit(c: Cluster, rids: list[str]) -> dict[str, int]:
    """Completed, duplicated (more than one final event) and lost (no final state) requests."""
    r = c.sync()
    done = duplicated = lost = 0
    for rid in rids:
        finals = [f for _, f in r.xrange(KEYS.reply(rid)) if f.get("kind") == "final"]
        state = r.hget(KEYS.status(rid), "state")
        done += state == "done"
        duplicated += len(finals) > 1
        lost += state not in ("done", "failed", "expired", "cancelled") or not finals
    return {"completed": done, "duplicated": duplicated, "lost": lost}


def wait_final(c: Cluster, rids: list[str], timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    r = c.sync()
    pending = set(rids)
    while pending and time.monotonic() < deadline:
        pending = {rid for rid in pending
                   if r.hget(KEYS.status(rid), "state") not in ("done", "failed", "expired", "cancelled")}
        time.sleep(0.1)


def crash_until_final(c: Cluster, rid: str, worker: str = "a", timeout_s: float = 120, **env: str) -> int:
    """Restart `worker` each time it dies (as a supervisor would) until `rid` is final;
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
