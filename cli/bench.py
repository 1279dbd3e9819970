"""`sluice bench`: figures measured in one run against a baseline measured in the same run.

- `throughput`: N concurrent requests x T tokens through the api, and the same prompts on
  AsyncLLMEngine directly in this process, alternating, as output tokens/s and their ratio.
- `startup`: seconds from `sluice up` to the first streamed token, with the default model
  not yet prepared (an empty cache) and prepared.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import typer

from sluice.broker.embedded import EmbeddedRedis, free_port
from sluice.config.model import load_models
from sluice.config.settings import Settings

bench_app = typer.Typer(no_args_is_help=True, help="Measure Sluice against a baseline in the same run.")

PROMPTS = [f"Write a short note about topic number {i}:" for i in range(256)]


def _wait_ready(url: str, procs: list[subprocess.Popen], timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a Sluice process exited before it was ready")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(url)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()


async def _through_api(url: str, prompts: list[str], max_tokens: int) -> tuple[float, int]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        t0 = time.perf_counter()

        async def one(prompt: str) -> int:
            r = await client.post("/v1/requests", json={"prompt": prompt, "max_tokens": max_tokens,
                                                         "temperature": 0.0})
            rid = r.json()["id"]
            while True:
                body = (await client.get(f"/v1/requests/{rid}", params={"wait": 30})).json()
                if body["status"] not in ("queued", "running"):
                    return body["output"]["num_output_tokens"]

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


def _direct_engine(settings: Settings, model_name: str | None):
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
    m, engine = _direct_engine(settings, model)
    try:
        await _direct(engine, prompts[:2], 4)  # warm-up
        secs, toks = await _direct(engine, prompts, max_tokens)
    finally:
        engine.shutdown()
    return m, secs, toks


@bench_app.command("throughput")
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
        with tempfile.TemporaryDirectory() as tmp:
            redis = EmbeddedRedis(Path(tmp)).start()
            port = free_port()
            env = {**os.environ, "SLUICE_REDIS_URL": redis.url}
            cli = [sys.executable, "-m", "sluice.cli"]
            procs = [subprocess.Popen([*cli, "worker", "--model", m.name], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
                     subprocess.Popen([*cli, "api", "--port", str(port)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
            try:
                url = f"http://127.0.0.1:{port}"
                _wait_ready(url, procs)
                asyncio.run(_through_api(url, prompts[:2], 4))  # warm-up
                secs, toks = asyncio.run(_through_api(url, prompts, max_tokens))
            finally:
                _stop(procs)
                redis.stop()
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
        _wait_ready(url, [up])
        with httpx.Client(base_url=url, timeout=120) as client:
            rid = client.post("/v1/requests", json={"prompt": "The capital of France is", "max_tokens": 4,
                                                    "temperature": 0.0}).json()["id"]
            with client.stream("GET", f"/v1/requests/{rid}/events") as response:
                for line in response.iter_lines():
                    if line.startswith("event: delta"):
                        return time.perf_counter() - t0
        raise RuntimeError("no token came back")
    finally:
        _stop([up])


@bench_app.command("startup")
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
