"""`sluice up`, the README's first command: local Redis, the api, every model's replicas and the
jobs worker, stopped together; a console that shows Sluice's progress, not every process's log;
and `sluice up --from oci://...` serving a model that `sluice publish` pushed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from sluice.supervisor.processes import free_port, wait_ready
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
    # A session of its own, as a shell gives a job: a terminal's Ctrl-C is then killpg(SIGINT)
    up = subprocess.Popen([sys.executable, "-m", "sluice.cli", "up", "--port", str(port), *args], env=env,
                          stdout=open(console, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    return up, port, console


def wait_up(url: str, up: subprocess.Popen, console: Path, data: Path) -> None:
    """wait_ready, and on failure why: the console and the end of every process's log (a CI run's
    timeout said only 'not ready after 300s')."""
    try:
        wait_ready(url, [up], timeout_s=300)
    except (TimeoutError, RuntimeError) as err:
        tails = [f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
                 for p in sorted((data / "logs").glob("*.log"))]
        raise AssertionError("\n".join([str(err), "--- console", console.read_text(errors="replace"), *tails])) from err


def end(up: subprocess.Popen) -> None:
    """What a failed test leaves running: `sluice up` is stopped as a user stops it (its children
    run in sessions of their own, so a SIGKILL of it alone left a CI run's api, workers, vLLM
    engine, webhook sender and Redis running for the rest of the run), and what outlives it is killed."""
    if up.poll() is not None:
        return
    children = psutil.Process(up.pid).children(recursive=True)
    up.send_signal(signal.SIGTERM)
    try:
        up.wait(120)
    except subprocess.TimeoutExpired:
        up.kill()
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()


def generate(url: str, model: str) -> dict:
    with httpx.Client(base_url=url, timeout=60) as client:
        rid = client.post("/v1/requests", json={"model": model, "prompt": "The capital of France is",
                                                "max_tokens": 4, "temperature": 0}).json()["id"]
        return client.get(f"/v1/requests/{rid}", params={"wait": 60}).json()


def stop(up: subprocess.Popen, port: int, children: list[int], *, ctrl_c: bool = False) -> None:
    """SIGTERM to `sluice up`, or Ctrl-C as a terminal sends it: SIGINT to its whole process group
    (the children, in sessions of their own, get only what `sluice up` sends them, in order)."""
    stopping = time.time()
    if ctrl_c:
        os.killpg(up.pid, signal.SIGINT)
    else:
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
        wait_up(url, up, console, tmp_path / "data")
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
        assert len(children) == 7  # redis-server, api, three workers, jobs, the webhook sender
        stop(up, port, children, ctrl_c=True)
    finally:
        end(up)
    shown = console.read_text()
    lines = shown.splitlines()
    assert "Sluice is up" in shown and "worker echo-1 ready" in shown and "metrics at http://" in shown
    assert "HTTP Request" not in shown and "GET /readyz" not in shown and "GET /healthz" not in shown
    assert len(lines) < 25, shown  # the engine's load and the access log went to files
    assert lines[-1].endswith("stopped; nothing it started is left running"), shown
    logs = tmp_path / "data" / "logs"
    assert {"api.log", "jobs.log", "solo-0.log", "echo-0.log", "echo-1.log"} <= {p.name for p in logs.iterdir()}
    assert "vllm" in (logs / "solo-0.log").read_text().lower()
    for log in logs.iterdir():  # each drained and stopped while Redis still answered
        assert "Traceback" not in log.read_text(errors="replace"), (log.name, log.read_text(errors="replace")[-3000:])


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
            wait_up(url, up, console, tmp_path / "data")
            result = generate(url, "edge")
            assert result["status"] == "done" and result["output"]["text"].startswith(" Paris")
            deployed = httpx.get(f"{url}/v1/models/edge").json()
            assert deployed["mode"] == "dynamic"  # the batching configuration came with it
            children = [int(p) for p in subprocess.run(["pgrep", "-P", str(up.pid)], capture_output=True,
                                                       text=True).stdout.split()]
            stop(up, port, children)
        finally:
            end(up)
    pulled = tmp_path / "data" / "oci"
    assert (pulled / f"{registry.host.replace(':', '_')}_sluice_edge_v1" / "model" / "config.json").is_file()


NULL_MODEL = "models:\n  - name: m\n    path: /no/model/needed\n"  # served by the null engine


def up_console(tmp_path: Path, name: str, data: Path, port: int, **env: str) -> tuple[subprocess.Popen, Path]:
    """`sluice up` with null-engine workers, its port given by SLUICE_API_PORT (not --port)."""
    models = tmp_path / "models.yaml"
    models.write_text(NULL_MODEL)
    env = {**{k: v for k, v in os.environ.items() if k not in ("SLUICE_REDIS_URL", "SLUICE_API_HOST")},
           "SLUICE_DATA_DIR": str(data), "SLUICE_MODELS_FILE": str(models), "SLUICE_WORKER_ENGINE": "null",
           "SLUICE_API_PORT": str(port), **env}
    console = tmp_path / f"{name}.txt"
    proc = subprocess.Popen([sys.executable, "-m", "sluice.cli", "up"], env=env, stdout=open(console, "wb"),
                            stderr=subprocess.STDOUT)
    return proc, console


def test_one_up_per_data_dir_a_busy_port_stops_it_first_and_it_says_why_it_stopped(tmp_path: Path) -> None:
    """Issue 30, defects 1, 2, 3 and 10: a second `sluice up` on the same data directory, or one
    whose port is taken, says so in one line and starts nothing; operator commands find the
    running one's Redis; a process that dies takes the stack down with its reason on the
    console, and the console says what is left (nothing)."""
    data = tmp_path / "data"
    port = free_port()
    up, console = up_console(tmp_path, "first", data, port)
    try:
        wait_up(f"http://127.0.0.1:{port}", up, console, data)  # SLUICE_API_PORT was heard
        recorded = (data / "redis-url").read_text().strip()
        assert recorded.startswith("redis://127.0.0.1:")

        env = {k: v for k, v in os.environ.items() if k != "SLUICE_REDIS_URL"} | {"SLUICE_DATA_DIR": str(data)}
        dlq = subprocess.run([sys.executable, "-m", "sluice.cli", "dlq", "list", "--model", "m"], env=env,
                             capture_output=True, text=True, timeout=120)
        assert dlq.returncode == 0 and f"Redis: {recorded} (the sluice up running on {data})" in dlq.stderr, dlq
        assert "no dead letters for m" in dlq.stderr

        second, second_console = up_console(tmp_path, "second", data, free_port())  # same data, free port
        assert second.wait(120) == 2
        shown = second_console.read_text().splitlines()
        assert len(shown) == 1 and "another sluice up" in shown[0] and str(data) in shown[0], shown

        other = tmp_path / "other"
        third, third_console = up_console(tmp_path, "third", other, port)  # its own data, a taken port
        assert third.wait(120) == 2
        shown = third_console.read_text().splitlines()
        assert len(shown) == 1 and f"port {port} on 127.0.0.1 is taken" in shown[0], shown
        assert not (other / "redis").exists()  # nothing was started

        [worker] = httpx.get(f"http://127.0.0.1:{port}/v1/workers").json()["workers"]
        assert worker["pid"] in {c.pid for c in psutil.Process(up.pid).children()}
        os.kill(worker["pid"], signal.SIGKILL)
        assert up.wait(120) == 1
    finally:
        end(up)
    lines = console.read_text().splitlines()
    assert any("worker m-0 exited with -9; its log is" in x and "ERROR" in x for x in lines), lines
    assert lines[-1].endswith("stopped; nothing it started is left running"), lines
    assert not (data / "redis-url").exists()
