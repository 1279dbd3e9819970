"""`sluice up`, the README's first command: local Redis, the api, every model's replicas and the
jobs worker, stopped together; a console that shows Sluice's progress, not every process's log;
and `sluice up --from oci://...` serving a model that `sluice publish` pushed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from sluice.cli.processes import free_port, wait_ready
from tests.cli.registry import running_registry
from tests.e2e.conftest import ENGINE

# Its own engine (sluice up starts one): beside the shared stack, in another xdist process.
pytestmark = [pytest.mark.engine, pytest.mark.xdist_group("up")]

TWO_MODELS = f"""models:
  - name: solo
    path: builtin:smollm2-135m-instruct{ENGINE}
  - name: echo
    framework: custom
    runtime: tests.e2e.runtimes:NullRuntime
    path: builtin:smollm2-135m-instruct
    deployment: {{replicas: 2, cpus: 1, memory: 1Gi}}
"""


def held_since_before(port: int, since: float) -> list[int]:
    """Processes listening on `port` that were started before `since`: the api, or an orphan
    that inherited its socket. (A test beside this one may bind the port once it is free: a
    parallel test's redis-server took it within 10 s once.)"""
    held = []
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid:
            try:
                if psutil.Process(c.pid).create_time() < since:
                    held.append(c.pid)
            except psutil.NoSuchProcess:
                pass
    return held


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def start_up(tmp_path: Path, *args: str, models: Path | None = None) -> tuple[subprocess.Popen, int, Path]:
    env = {k: v for k, v in os.environ.items() if k not in ("SLUICE_REDIS_URL", "SLUICE_MODELS_FILE")}
    env.update(SLUICE_DATA_DIR=str(tmp_path / "data"))
    if models is not None:
        env["SLUICE_MODELS_FILE"] = str(models)
    port = free_port()
    console = tmp_path / "console.txt"
    up = subprocess.Popen([sys.executable, "-m", "sluice.cli", "up", "--port", str(port), *args], env=env,
                          stdout=open(console, "wb"), stderr=subprocess.STDOUT)
    return up, port, console


def generate(url: str, model: str) -> dict:
    with httpx.Client(base_url=url, timeout=60) as client:
        rid = client.post("/v1/requests", json={"model": model, "prompt": "The capital of France is",
                                                "max_tokens": 4, "temperature": 0}).json()["id"]
        return client.get(f"/v1/requests/{rid}", params={"wait": 60}).json()


def stop(up: subprocess.Popen, port: int, children: list[int]) -> None:
    stopping = time.time()
    up.send_signal(signal.SIGTERM)
    assert up.wait(90) == 0
    assert held_since_before(port, stopping) == []
    assert [pid for pid in children if alive(pid)] == []


def test_up_serves_every_model_and_replica_and_stops_everything_it_started(tmp_path: Path, model_dir: Path) -> None:
    models = tmp_path / "models.yaml"
    models.write_text(TWO_MODELS)
    up, port, console = start_up(tmp_path, models=models)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, [up], timeout_s=300)
        solo, echo = generate(url, "solo"), generate(url, "echo")
        assert solo["status"] == "done" and solo["output"]["text"].startswith(" Paris")
        assert echo["status"] == "done" and echo["output"]["text"] == " t0 t1 t2 t3"
        assert (tmp_path / "data" / "redis" / "appendonlydir").is_dir()  # a local Redis, AOF on

        workers = httpx.get(f"{url}/v1/workers").json()["workers"]
        assert sorted((w["name"], w["model"]) for w in workers) == [("echo-0", "echo"), ("echo-1", "echo"),
                                                                   ("solo-0", "solo")]
        for w in workers:  # every process's metrics, reachable from the list
            scraped = httpx.get(w["metrics_url"]).text
            assert f'sluice_num_requests_running{{model="{w["model"]}",worker="{w["name"]}"}}' in scraped
        pinned = {w["name"]: Path(f"/proc/{w['pid']}/status").read_text() for w in workers}
        assert all("Cpus_allowed_list:\t" in s for s in pinned.values())
        cores = {n: s.split("Cpus_allowed_list:\t")[1].split()[0] for n, s in pinned.items()}
        assert cores["echo-0"] != cores["echo-1"]  # cpus: 1 each, cores of their own

        children = [int(p) for p in subprocess.run(["pgrep", "-P", str(up.pid)], capture_output=True,
                                                   text=True).stdout.split()]
        assert len(children) == 6  # redis-server, api, three workers, jobs
        stop(up, port, children)
    finally:
        if up.poll() is None:
            up.kill()
    shown = console.read_text()
    lines = shown.splitlines()
    assert "Sluice is up" in shown and "worker echo-1 ready" in shown and "metrics at http://" in shown
    assert "HTTP Request" not in shown and "GET /readyz" not in shown and "GET /healthz" not in shown
    assert len(lines) < 25, shown  # the engine's load and the access log went to files
    logs = tmp_path / "data" / "logs"
    assert {"api.log", "jobs.log", "solo-0.log", "echo-0.log", "echo-1.log"} <= {p.name for p in logs.iterdir()}
    assert "vllm" in (logs / "solo-0.log").read_text().lower()


def test_a_published_model_is_pulled_and_served_with_no_other_file(tmp_path: Path, model_dir: Path) -> None:
    models = tmp_path / "models.yaml"
    models.write_text(f"models:\n  - name: edge\n    path: builtin:smollm2-135m-instruct{ENGINE}"
                      "    dynamic_batching_config: {max_batch_delay_ms: 20, batch_size_target: 2}\n")
    with running_registry(tmp_path / "registry") as registry:
        target = f"oci://{registry.host}/sluice/edge:v1"
        pushed = subprocess.run([sys.executable, "-m", "sluice.cli", "publish", "edge", target, "--models-file",
                                 str(models)], capture_output=True, text=True, timeout=300)
        assert pushed.returncode == 0, pushed.stderr
        up, port, console = start_up(tmp_path, "--from", target)  # no models file, another data dir
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, [up], timeout_s=300)
            result = generate(url, "edge")
            assert result["status"] == "done" and result["output"]["text"].startswith(" Paris")
            deployed = httpx.get(f"{url}/v1/models/edge").json()
            assert deployed["mode"] == "dynamic"  # the batching configuration came with it
            children = [int(p) for p in subprocess.run(["pgrep", "-P", str(up.pid)], capture_output=True,
                                                       text=True).stdout.split()]
            stop(up, port, children)
        finally:
            if up.poll() is None:
                up.kill()
    pulled = tmp_path / "data" / "oci"
    assert (pulled / f"{registry.host.replace(':', '_')}_sluice_edge_v1" / "model" / "config.json").is_file()
