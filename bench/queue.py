"""`sluice bench queue` and `sluice bench scale`: what the queue itself costs, with the null
engine (no model): Sluice round trips against a Celery task round trip on the same Redis,
and Sluice's throughput with 1, 2, 4 ... workers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import httpx
import typer

from sluice.bench.commands import per_request
from sluice.bench.loadgen import p50_p99
from sluice.supervisor.stack import LocalStack

MODELS = "models:\n  - name: echo\n    continuous_batching_config: {max_concurrent_batch_size: 256}\n"


@contextlib.contextmanager
def _null_stack(workers: int) -> Iterator[tuple[str, str]]:
    with tempfile.TemporaryDirectory() as tmp, LocalStack(Path(tmp), MODELS, appendonly=False,
                                                          env={"SLUICE_LOG_LEVEL": "WARNING"}) as stack:
        url = stack.up(["echo"] * workers, engine="null", timeout_s=60).url
        deadline = time.monotonic() + 30
        while len(httpx.get(f"{url}/v1/workers").json()["workers"]) < workers:
            assert time.monotonic() < deadline, "workers did not come up"
            time.sleep(0.2)
        assert stack.redis_url is not None  # up() started Redis
        yield url, stack.redis_url


async def _sluice_round_trips(url: str, n: int, concurrency: int,
                              one_call: bool = False) -> tuple[float, list[float], dict]:
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120),
                                     connector=aiohttp.TCPConnector(limit=concurrency * 2)) as client:
        async def one(i: int) -> float:
            async with sem:
                t0 = time.perf_counter()
                submit = {"prompt": f"echo {i}", "max_tokens": 4}
                if one_call:  # Prefer: wait=S: the result in the submit's answer
                    async with client.post(f"{url}/v1/requests", json=submit,
                                           headers={"Prefer": "wait=60"}) as r:
                        body = await r.json()
                else:
                    async with client.post(f"{url}/v1/requests", json=submit) as r:
                        rid = (await r.json())["id"]
                    async with client.get(f"{url}/v1/requests/{rid}", params={"wait": 60}) as r:
                        body = await r.json()
                assert body["status"] == "done", body
                return time.perf_counter() - t0

        await asyncio.gather(*(one(i) for i in range(min(n, 50))))  # warm-up
        t0 = time.perf_counter()
        latencies = await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - t0
    workers = httpx.get(f"{url}/v1/workers").json()["workers"]
    return wall, sorted(latencies), {"workers": len(workers)}


def _celery_round_trips(redis_url: str, n: int, concurrency: int) -> tuple[float, list[float]]:
    env = {**os.environ, "SLUICE_REDIS_URL": redis_url}
    worker = subprocess.Popen([sys.executable, "-m", "celery", "-A", "sluice.bench.celery_echo", "worker",
                               "--pool=threads", "--concurrency=8", "--loglevel=WARNING", "-Q", "sluice-echo",
                               "--without-gossip", "--without-mingle"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ["SLUICE_REDIS_URL"] = redis_url
    from sluice.bench.celery_echo import app, echo

    app.conf.broker_url = app.conf.result_backend = redis_url
    try:
        echo.delay("warm-up", 4).get(timeout=60)

        def one(i: int) -> float:
            t0 = time.perf_counter()
            result = echo.delay(f"echo {i}", 4).get(timeout=120)
            assert result["num_output_tokens"] == 4
            return time.perf_counter() - t0

        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, range(min(n, 50))))  # warm-up
            t0 = time.perf_counter()
            latencies = list(pool.map(one, range(n)))
            wall = time.perf_counter() - t0
    finally:
        worker.terminate()
        worker.wait(30)
    return wall, sorted(latencies)


def _stats(wall: float, lat: list[float], n: int) -> dict:
    return {"round_trips_per_s": n / wall, **{f"latency_{k}": v for k, v in p50_p99(lat, "ms", 1e3).items()}}


def _one_run(url: str, redis_url: str, requests: int, concurrency: int, celery_first: bool) -> dict:
    """Sluice's two routes and Celery, one after the other (never at once)."""
    run: dict = {"sluice": {}}
    for side in (["celery", "sluice"] if celery_first else ["sluice", "celery"]):
        if side == "celery":
            run["celery"] = _stats(*_celery_round_trips(redis_url, requests, concurrency), requests)
            typer.echo(f"celery: {json.dumps(run['celery'])}")
            continue
        for route, one_call in (("one_call", True), ("submit_and_poll", False)):
            wall, lat, _ = asyncio.run(_sluice_round_trips(url, requests, concurrency, one_call))
            run["sluice"][route] = _stats(wall, lat, requests)
            typer.echo(f"sluice {route}: {json.dumps(run['sluice'][route])}")
    run["sluice_vs_celery_throughput"] = {route: row["round_trips_per_s"] / run["celery"]["round_trips_per_s"]
                                          for route, row in run["sluice"].items()}
    return run


def queue(
    requests: int = typer.Option(2000, help="Round trips per system."),
    concurrency: int = typer.Option(32, help="Round trips in flight at once."),
    repeat: int = typer.Option(1, help="Measure both sides this many times, alternating which goes first, "
                                       "and report the median ratio (a shared machine drifts between runs)."),
    out: Path = typer.Option(None, help="Write the figures as JSON here."),
) -> None:
    """Null engine: Sluice round trips (one call with `Prefer: wait`, and submit + long-poll) vs a
    Celery echo task (delay + get) on the same Redis; then Redis commands per request."""
    with _null_stack(1) as (url, redis_url):
        runs = [_one_run(url, redis_url, requests, concurrency, celery_first=k % 2 == 1)
                for k in range(max(1, repeat))]
        cost = [per_request(url, redis_url, streamed=streamed) for streamed in (False, True)]
        for row in cost:
            typer.echo(f"redis commands: {json.dumps(row)}")
    figures = {"requests": requests, "concurrency": concurrency, **runs[0], "redis_commands": cost}
    if len(runs) > 1:
        figures["repeats"] = runs
        figures["median_sluice_vs_celery_throughput"] = {
            route: statistics.median([r["sluice_vs_celery_throughput"][route] for r in runs])
            for route in runs[0]["sluice"]}
    typer.echo(json.dumps(figures, indent=2))
    if out:
        out.write_text(json.dumps(figures, indent=2))


def scale(
    workers: str = typer.Option("1,2,4", help="Worker counts to measure."),
    requests: int = typer.Option(2000, help="Round trips per measurement."),
    concurrency: int = typer.Option(128, help="Round trips in flight at once."),
    out: Path = typer.Option(None, help="Write the figures as JSON here."),
) -> None:
    """Null engine: Sluice's round trips per second with 1, 2, 4 ... workers on one Redis."""
    figures = []
    for n in [int(x) for x in workers.split(",")]:
        with _null_stack(n) as (url, _):
            wall, lat, info = asyncio.run(_sluice_round_trips(url, requests, concurrency))
        row = {"workers": n, **_stats(wall, lat, requests)}
        figures.append(row)
        typer.echo(json.dumps(row))
    if out:
        out.write_text(json.dumps(figures, indent=2))
