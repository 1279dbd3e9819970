"""A real stack for end-to-end tests: its own redis-server, one vLLM worker, one api.

Two engines per test session, started once and shared by every test: the default
deployment's (continuous; the batching tests switch it to dynamic or single and back, as a
user would with `PUT /v1/models/{name}/config`) and the custom runtime's. The model runs in
float32 so that batching cannot change greedy results.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis as redis_sync

from sluice.config.settings import Settings
from sluice.supervisor.processes import EmbeddedRedis
from sluice.supervisor.stack import LocalStack
from sluice.workers.model_prep import prepare_default_model

# Shorter than the long generations of the tests: leases must hold them (tests/e2e/test_long_batches.py).
LEASE_TIMEOUT_S = 3.0
MODEL = "smollm2"  # continuous batching, unless a test switches it (see `restore_continuous`)
DYNAMIC = MODEL  # the batching tests reconfigure the one deployment between modes
CONTINUOUS = {"continuous_batching_config": {"max_concurrent_batch_size": 64}}
DYNAMIC_CONFIG = {"dynamic_batching_config": {"max_batch_delay_ms": 50, "batch_size_target": 4,
                                              "batch_size_limit": 8}}
CUSTOM = "smollm2-custom"  # the example custom runtime
ENGINE = """
    framework_config:
      dtype: float32
      enforce_eager: true
      max_model_len: 2048
      max_num_seqs: 64
      cpu_kvcache_space_gib: 1
"""
MODELS_YAML = f"""
models:
  - name: {MODEL}
    path: builtin:smollm2-135m-instruct{ENGINE}
    continuous_batching_config:
      max_concurrent_batch_size: 64
  - name: {CUSTOM}
    framework: custom
    runtime: sluice.workers.engines.system_prompt:SystemPromptRuntime
    path: builtin:smollm2-135m-instruct{ENGINE}
    input_schema:
      - {{name: prompt, type: string, nullable: false}}
      - {{name: max_tokens, type: int64}}
      - {{name: system_prompt, type: string}}
    output_schema:
      - {{name: generated_text, type: string}}
      - {{name: num_output_tokens, type: int64}}
      - {{name: num_words, type: int64}}
    dynamic_batching_config:
      max_batch_delay_ms: 100
      batch_size_target: 2
"""


@dataclass
class Stack:
    url: str
    redis_url: str
    env: dict[str, str]
    models_file: Path
    model_dir: Path
    workers: list[subprocess.Popen]
    api: subprocess.Popen


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return prepare_default_model(Settings().cache_dir)


@pytest.fixture(scope="session")
def e2e_models_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "models.yaml"
    path.write_text(MODELS_YAML)
    return path


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory, model_dir: Path, e2e_models_file: Path) -> Iterator[Stack]:
    env = {"SLUICE_HEARTBEAT_INTERVAL_S": "0.5", "SLUICE_CANCEL_POLL_S": "0.1",
           "SLUICE_LEASE_TIMEOUT_S": str(LEASE_TIMEOUT_S)}
    with LocalStack(tmp_path_factory.mktemp("e2e"), models_file=e2e_models_file, env=env, output="inherit") as local:
        local.up([MODEL, CUSTOM], names=[f"e2e-{m}" for m in (MODEL, CUSTOM)])
        yield Stack(local.url, local.redis_url or "", local.child_env, e2e_models_file, model_dir,
                    list(local.workers.values()), next(iter(local.apis.values())))


@dataclass
class NullStack:
    url: str
    redis: EmbeddedRedis
    env: dict[str, str]
    procs: dict[str, subprocess.Popen]


@contextlib.contextmanager
def null_stack(tmp: Path, models_yaml: str, model: str, *, password: str | None = None,
               tls: tuple[Path, Path] | None = None, jobs: bool = False,
               **env: str) -> Iterator[NullStack]:
    """A private Redis, a null-engine worker and an api: for tests of the api and the queue."""
    with LocalStack(tmp, models_yaml, redis_password=password, redis_tls=tls,
                    env={"SLUICE_LOG_LEVEL": "WARNING", **env}) as local:
        local.up([model], engine="null", jobs=jobs, timeout_s=60)
        assert local.redis is not None
        procs = {"worker": next(iter(local.workers.values())), "api": next(iter(local.apis.values())),
                 **({"jobs": local.jobs} if local.jobs else {})}
        try:
            yield NullStack(local.url, local.redis, local.child_env, procs)
        finally:
            # A process a test started in place of one it killed is not the local stack's:
            # stop it here, or it outlives the run (a Celery worker retrying a gone Redis).
            for proc in procs.values():
                if proc.poll() is None and proc not in local.processes:
                    proc.terminate()
                    try:
                        proc.wait(30)
                    except subprocess.TimeoutExpired:
                        proc.kill()


async def submit(client: httpx.AsyncClient, model: str = MODEL, **body) -> str:
    r = await client.post("/v1/requests", json={"model": model, **body})
    assert r.status_code == 202, r.text
    data = r.json()
    assert data["status"] == "queued" and data["model"] == model
    return data["id"]


async def wait_done(client: httpx.AsyncClient, rid: str, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = await client.get(f"/v1/requests/{rid}", params={"wait": 30})
        assert r.status_code == 200, r.text
        if r.json()["status"] not in ("queued", "running"):
            return r.json()
    raise TimeoutError(rid)


def settled_log(r: redis_sync.Redis, key: str, wanted: set[str], timeout_s: float = 15.0) -> list[dict]:
    """The inference-log records of `wanted`, read once every one has its record and the worker's
    log buffer (flushed every 0.1 s) has had time to land a second, so a test can count them."""
    deadline = time.monotonic() + timeout_s

    def records() -> list[dict]:
        logged = (json.loads(f["data"]) for _, f in r.xrange(key))
        return [x for x in logged if x["request_id"] in wanted]

    while {x["request_id"] for x in records()} < wanted and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # five flush intervals: a record written twice would be here by now
    return records()


@pytest.fixture
async def client(stack: Stack):
    async with httpx.AsyncClient(base_url=stack.url, timeout=120) as c:
        yield c


async def configure(client: httpx.AsyncClient, model: str, body: dict) -> int:
    """Apply a batching configuration and wait until the model's worker runs the new version."""
    r = await client.put(f"/v1/models/{model}/config", json=body)
    assert r.status_code == 200, r.text
    version = r.json()["version"]
    deadline = time.monotonic() + 60
    while True:
        workers = (await client.get(f"/v1/models/{model}")).json()["workers"]
        if workers and all(w["version"] == version for w in workers):
            return version
        assert time.monotonic() < deadline, f"workers did not switch to v{version}: {workers}"
        await asyncio.sleep(0.2)


@pytest.fixture
async def restore_continuous(client: httpx.AsyncClient) -> AsyncIterator[None]:
    """A test that switches the default deployment's batching mode leaves it continuous again
    (an unchanged configuration keeps its version: a no-op when nothing was switched)."""
    yield
    await configure(client, MODEL, CONTINUOUS)


@pytest.fixture
async def dynamic(client: httpx.AsyncClient, restore_continuous: None) -> None:
    """The default deployment in dynamic mode for the test."""
    await configure(client, MODEL, DYNAMIC_CONFIG)
