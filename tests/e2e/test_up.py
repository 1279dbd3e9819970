"""`sluice up`, the README's first command: local Redis, api and one worker, stopped together."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from sluice.cli.processes import free_port, wait_ready
from tests.e2e.conftest import ENGINE

# Its own engine (sluice up starts one): beside the shared stack, in another xdist process.
pytestmark = [pytest.mark.engine, pytest.mark.xdist_group("up")]


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_up_serves_and_stops_everything_it_started(tmp_path: Path, model_dir: Path) -> None:
    models = tmp_path / "models.yaml"
    models.write_text(f"models:\n  - name: solo\n    path: builtin:smollm2-135m-instruct{ENGINE}")
    env = {k: v for k, v in os.environ.items() if k != "SLUICE_REDIS_URL"}
    env.update(SLUICE_MODELS_FILE=str(models), SLUICE_DATA_DIR=str(tmp_path / "data"))
    port = free_port()
    up = subprocess.Popen([sys.executable, "-m", "sluice.cli", "up", "--port", str(port)], env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, [up], timeout_s=300)
        with httpx.Client(base_url=url, timeout=60) as client:
            rid = client.post("/v1/requests", json={"prompt": "The capital of France is", "max_tokens": 4,
                                                    "temperature": 0}).json()["id"]
            result = client.get(f"/v1/requests/{rid}", params={"wait": 60}).json()
        assert result["status"] == "done" and result["output"]["text"].startswith(" Paris")
        assert (tmp_path / "data" / "redis" / "appendonlydir").is_dir()  # a local Redis, AOF on
        children = [int(p) for p in subprocess.run(["pgrep", "-P", str(up.pid)], capture_output=True,
                                                   text=True).stdout.split()]
        assert len(children) == 4  # redis-server, api, worker, jobs
        up.send_signal(signal.SIGTERM)
        assert up.wait(90) == 0
        assert not port_open(port)
        assert [pid for pid in children if alive(pid)] == []
    finally:
        if up.poll() is None:
            up.kill()
