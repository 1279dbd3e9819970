"""`sluice bench`: figures measured in one run against a baseline measured in the same run.

- `throughput`: N concurrent requests x T tokens through the api, and the same prompts on
  AsyncLLMEngine directly in this process, alternating, as output tokens/s and their ratio.
- `startup`: seconds from `sluice up` to the first streamed token, with the default model
  not yet prepared (an empty cache) and prepared.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import typer

from sluice.bench.loadgen import p50_p99
from sluice.bench.sse import events
from sluice.config.model import load_models
from sluice.config.settings import Settings
from sluice.supervisor.processes import free_port, stop_processes, wait_ready
from sluice.supervisor.stack import LocalStack

PROMPTS = [f"Write a short note about topic number {i}:" for i in range(256)]


@contextlib.contextmanager
def local_stack(model: str, *, jobs: bool = False) -> Iterator[str]:
    """A private Redis, one worker for `model` and one api (and a jobs worker); yields the api's URL."""
    with tempfile.TemporaryDirectory() as tmp, LocalStack(Path(tmp)) as stack:
        yield stack.up([model], jobs=jobs, timeout_s=900).url


async def request_result(client: httpx.AsyncClient, prompt: str, max_tokens: int,
                         model: str | None = None) -> dict:
    """Submit one greedy request and long-poll until its final result."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            **({"model": model} if model else {})}
    rid = (await client.post("/v1/requests", json=body)).json()["id"]
    while True:
        result = (await client.get(f"/v1/requests/{rid}", params={"wait": 60})).json()
        if result["status"] not in ("queued", "running"):
            return result


async def _through_api(url: str, prompts: list[str], max_tokens: int) -> tuple[float, int]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        t0 = time.perf_counter()

        async def one(prompt: str) -> int:
            return (await request_result(client, prompt, max_tokens))["output"]["num_output_tokens"]

        tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
        return time.perf_counter() - t0, tokens


async def _direct(engine, prompts: list[str], max_tokens: int) -> tuple[float, int]:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, output_kind=RequestOutputKind.DELTA)
    t0 = time.perf_counter()

    async def one(i: int, prompt: str) -> int:
        n = 0
        async for out in engine.generate(prompt, params, request_id=f"bench-{time.time_ns()}-{i}"):
            n += len(out.outputs[0].token_ids)
        return n

    tokens = sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    return time.perf_counter() - t0, tokens


def direct_engine(settings: Settings, model_name: str | None):
    """The baseline: AsyncLLMEngine in this process, with the deployment's engine options.
    Create it inside the event loop that uses it (its output handler lives there)."""
    from vllm import AsyncEngineArgs, AsyncLLMEngine

    from sluice.workers.engines.vllm import engine_args
    from sluice.workers.model_prep import resolve_model_path

    models = load_models(settings.models_file)
    model = next((m for m in models if m.name == model_name), models[0])
    path = resolve_model_path(model.path, settings.cache_dir)
    kwargs, _ = engine_args(path, model.framework_config)
    return model, AsyncLLMEngine.from_engine_args(AsyncEngineArgs(**kwargs))


async def _direct_round(settings: Settings, model: str | None, prompts: list[str], max_tokens: int):
    # The engine's output handler lives on the running loop: create, use and shut it down in one.
    m, engine = direct_engine(settings, model)
    try:
        await _direct(engine, prompts[:2], 4)  # warm-up
        secs, toks = await _direct(engine, prompts, max_tokens)
    finally:
        engine.shutdown()
    return m, secs, toks


def throughput(
    concurrency: int = typer.Option(32, help="Requests submitted at once."),
    max_tokens: int = typer.Option(64, help="Output tokens per request."),
    rounds: int = typer.Option(2, help="Alternating rounds of each (the median is reported)."),
    model: str = typer.Option(None, help="Deployed model (default: the first in the models file)."),
    out: Path = typer.Option(None, help="Also write the figures as JSON here."),
) -> None:
    """Output tokens/s through the api vs AsyncLLMEngine directly, same prompts, same run."""
    settings = Settings()
    prompts = PROMPTS[:concurrency]
    results: dict[str, list[float]] = {"sluice": [], "direct": []}
    for r in range(rounds):
        # The direct engine and the stack never run at once: each gets the whole machine.
        m, secs, toks = asyncio.run(_direct_round(settings, model, prompts, max_tokens))
        results["direct"].append(toks / secs)
        typer.echo(f"round {r + 1}: direct  {toks} tokens in {secs:.2f}s = {toks / secs:.1f} tok/s")
        with local_stack(m.name) as url:
            asyncio.run(_through_api(url, prompts[:2], 4))  # warm-up
            secs, toks = asyncio.run(_through_api(url, prompts, max_tokens))
        results["sluice"].append(toks / secs)
        typer.echo(f"round {r + 1}: sluice  {toks} tokens in {secs:.2f}s = {toks / secs:.1f} tok/s")
    figures = {
        "concurrency": concurrency, "max_tokens": max_tokens, "rounds": rounds,
        "direct_tok_s": statistics.median(results["direct"]),
        "sluice_tok_s": statistics.median(results["sluice"]),
    }
    figures["ratio"] = figures["sluice_tok_s"] / figures["direct_tok_s"]
    typer.echo(json.dumps(figures, indent=2))
    if out:
        out.write_text(json.dumps(figures, indent=2))


def _first_token_after_up(cache_dir: Path, data_dir: Path) -> float:
    port = free_port()
    env = {**os.environ, "SLUICE_CACHE_DIR": str(cache_dir), "SLUICE_DATA_DIR": str(data_dir)}
    env.pop("SLUICE_REDIS_URL", None)
    t0 = time.perf_counter()
    up = subprocess.Popen([sys.executable, "-m", "sluice.cli", "up", "--port", str(port)], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, [up])
        with httpx.Client(base_url=url, timeout=120) as client:
            rid = client.post("/v1/requests", json={"prompt": "The capital of France is", "max_tokens": 4,
                                                    "temperature": 0.0}).json()["id"]
            with client.stream("GET", f"/v1/requests/{rid}/events") as response:
                for ev in events(response.iter_lines()):
                    if ev.event == "delta":
                        return time.perf_counter() - t0
        raise RuntimeError("no token came back")
    finally:
        stop_processes([up])


def startup(out: Path = typer.Option(None, help="Also write the figures as JSON here.")) -> None:
    """Seconds from `sluice up` to the first streamed token, model not prepared and prepared."""
    with tempfile.TemporaryDirectory() as tmp:
        cache, data = Path(tmp) / "cache", Path(tmp) / "data"
        cold = _first_token_after_up(cache, data)
        typer.echo(f"model not prepared: {cold:.1f}s to the first token")
        warm = _first_token_after_up(cache, data)
        typer.echo(f"model prepared:     {warm:.1f}s to the first token")
        shutil.rmtree(cache, ignore_errors=True)
    figures = {"first_token_s_unprepared": cold, "first_token_s_prepared": warm}
    typer.echo(json.dumps(figures, indent=2))
    if out:
        out.write_text(json.dumps(figures, indent=2))


MODES: dict[str, dict[str, object]] = {  # a mode's body for PUT /v1/models/{model}/config
    "continuous": {"continuous_batching_config": {"max_concurrent_batch_size": 256}},
    "dynamic": {"dynamic_batching_config": {"max_batch_delay_ms": 10, "batch_size_target": 8}},
    "single": {"batch_config": "single"},
}


async def _burst(url: str, model: str, mode: dict[str, object], lengths: list[int]) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        version = (await client.put(f"/v1/models/{model}/config", json=mode)).json()["version"]
        # until every worker runs the new configuration
        while any(w["version"] != version
                  for w in (await client.get(f"/v1/models/{model}")).json()["workers"]):
            await asyncio.sleep(0.2)

        results = await asyncio.gather(*(request_result(client, PROMPTS[i], n, model)
                                         for i, n in enumerate(lengths)))
    latencies = sorted(r["timings"]["finished"] - r["timings"]["enqueued"] for r in results)
    span = max(r["timings"]["finished"] for r in results) - min(r["timings"]["enqueued"] for r in results)
    tokens = sum(r["output"]["num_output_tokens"] for r in results)

    return {"requests": len(results), "output_tokens": tokens, "tok_s": tokens / span, **p50_p99(latencies),
            "wall_s": span}


def modes(
    requests: int = typer.Option(64, help="Requests in the burst."),
    seed: int = typer.Option(0, help="Seed of the max_tokens draw (16 to 128)."),
    model: str = typer.Option(None, help="Deployed model (default: the first in the models file)."),
    out: Path = typer.Option(None, help="Also write the figures as JSON here."),
) -> None:
    """The same burst (mixed max_tokens 16-128) under continuous, dynamic (target 8) and single mode."""
    import random

    from rich.console import Console
    from rich.table import Table

    name = model or load_models(Settings().models_file)[0].name
    rng = random.Random(seed)
    lengths = [rng.randint(16, 128) for _ in range(requests)]
    figures = {}
    with local_stack(name) as url:
        asyncio.run(_through_api(url, PROMPTS[:2], 4))  # warm-up
        for mode, body in MODES.items():
            figures[mode] = asyncio.run(_burst(url, name, body, lengths))
            typer.echo(f"{mode}: {json.dumps(figures[mode])}")
    table = Table(title=f"{requests}-request burst, max_tokens 16-128 (seed {seed}), model {name}")
    for col in ("mode", "output tok/s", "p50 latency s", "p99 latency s", "wall s"):
        table.add_column(col)
    for mode, f in figures.items():
        table.add_row(mode, f"{f['tok_s']:.1f}", f"{f['p50_s']:.2f}", f"{f['p99_s']:.2f}",
                      f"{f['wall_s']:.1f}")
    Console().print(table)
    if out:
        out.write_text(json.dumps(figures, indent=2))


async def _interactive_latencies(url: str, model: str, n: int, max_tokens: int) -> list[float]:
    """End-to-end latencies of n interactive requests, four at a time."""
    sem = asyncio.Semaphore(4)
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        async def one(i: int) -> float:
            async with sem:
                t = (await request_result(client, PROMPTS[i % len(PROMPTS)], max_tokens, model))["timings"]
                return t["finished"] - t["enqueued"]

        return sorted(await asyncio.gather(*(one(i) for i in range(n))))


def bulk(
    rows: int = typer.Option(1000, help="Rows in the bulk job."),
    max_tokens: int = typer.Option(32, help="Output tokens per row."),
    interactive: int = typer.Option(40, help="Interactive requests measured, alone and during the job."),
    model: str = typer.Option(None, help="Deployed model (default: the first in the models file)."),
    out: Path = typer.Option(None, help="Also write the figures as JSON here."),
) -> None:
    """Rows/s and output tokens/s of a bulk job, and interactive latency with and without it."""
    name = model or load_models(Settings().models_file)[0].name
    lines = "\n".join(json.dumps({"custom_id": str(i), "method": "POST", "url": "/v1/completions",
                                  "body": {"model": name, "prompt": PROMPTS[i % len(PROMPTS)],
                                           "max_tokens": max_tokens, "temperature": 0.0}})
                      for i in range(rows)).encode()
    with local_stack(name, jobs=True) as url:
        asyncio.run(_through_api(url, PROMPTS[:2], 4))  # warm-up
        alone = asyncio.run(_interactive_latencies(url, name, interactive, max_tokens))
        with httpx.Client(base_url=url, timeout=120) as client:
            f = client.post("/v1/files", files={"file": ("bulk.jsonl", lines)},
                            data={"purpose": "batch"}).json()
            t0 = time.perf_counter()
            batch = client.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/completions",
                                                      "completion_window": "24h"}).json()
            while client.get(f"/v1/batches/{batch['id']}").json()["request_counts"]["completed"] < rows // 10:
                time.sleep(0.2)
            during = asyncio.run(_interactive_latencies(url, name, interactive, max_tokens))
            while (batch := client.get(f"/v1/batches/{batch['id']}").json())["status"] not in (
                    "completed", "failed", "cancelled"):
                time.sleep(0.5)
            wall = time.perf_counter() - t0
    figures = {
        "rows": rows, "max_tokens": max_tokens, "status": batch["status"], "wall_s": wall,
        "rows_per_s": batch["request_counts"]["completed"] / wall,
        "output_tok_s": batch["usage"]["output_tokens"] / wall,
        "interactive_alone": p50_p99(alone), "interactive_during_job": p50_p99(during),
    }
    typer.echo(json.dumps(figures, indent=2))
    if out:
        out.write_text(json.dumps(figures, indent=2))
