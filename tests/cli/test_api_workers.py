"""`sluice api --workers N`: several api processes on one port, with a null worker behind
them. Every request is answered once, streams work, the metrics of a scrape are every
process's (the admitted counter sums them whichever process answers), and SIGTERM stops them all."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
from pathlib import Path

import httpx

from sluice.bench.sse import sse_events
from sluice.supervisor.stack import LocalStack

MODEL = "echo"
MODELS_YAML = f"models:\n  - name: {MODEL}\n    continuous_batching_config: {{max_concurrent_batch_size: 32}}\n"
N = 40


def children(pid: int) -> list[int]:
    """The api processes uvicorn started (not multiprocessing's resource tracker)."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split() if b"resource_tracker" not in _cmdline(int(x))]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def admitted(text: str) -> float:
    found = re.search(rf'^sluice_requests_admitted_total{{lane="interactive",model="{MODEL}"}} (\S+)$', text, re.M)
    assert found, text[:2000]
    return float(found.group(1))


async def one_call(url: str, i: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:  # a connection of its own
        r = await client.post("/v1/requests", json={"prompt": f"hello {i}", "max_tokens": 4},
                              headers={"Prefer": "wait=30"})
        assert r.status_code == 200, r.text
        return r.json()


def test_api_processes_share_one_port(tmp_path: Path) -> None:
    with LocalStack(tmp_path, MODELS_YAML, env={"SLUICE_LOG_LEVEL": "WARNING"}) as local:
        local.start_redis()
        local.start_worker(MODEL, engine="null")
        url = local.start_api(None, "--workers", "2")
        local.wait_ready(90)
        api = next(iter(local.apis.values()))
        assert len(children(api.pid)) == 2

        async def load() -> list[dict]:
            return await asyncio.gather(*(one_call(url, i) for i in range(N)))

        results = asyncio.run(load())
        assert [r["status"] for r in results] == ["done"] * N
        assert len({r["id"] for r in results}) == N

        async def stream() -> list[str]:
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                rid = (await client.post("/v1/requests", json={"prompt": "stream", "max_tokens": 5})).json()["id"]
                async with client.stream("GET", f"/v1/requests/{rid}/events") as response:
                    return [e.event async for e in sse_events(response)]

        kinds = asyncio.run(stream())
        assert kinds[-1] == "done" and kinds.count("delta") >= 1, kinds
        # Whichever process answers the scrape, it reports every process's admissions.
        for _ in range(6):
            with httpx.Client(base_url=url, timeout=30) as fresh:
                assert admitted(fresh.get("/metrics").text) == N + 1

        api.send_signal(signal.SIGTERM)
        assert api.wait(60) == 0
        assert children(api.pid) == []
