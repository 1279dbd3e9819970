"""`sluice bench tokens`: the per-token path at GPU rates, with the null engine.

`--streams` requests are kept running at once, each streaming one token every `--token-ms`
(20 × 1 ms asks for 20,000 tokens/s; what this machine reaches is reported), each followed
by a client over SSE, for `--seconds`. Reported: the tokens delivered per second, the CPU
time the worker and the api spent per 1,000 tokens (from /proc, their whole work: admission,
start, commit and the SSE stream of each request included, so long requests keep that
share small), and what the token path cost Redis: the reply script's calls per second and
tokens per call (the worker coalesces a flush's deltas per request), and the api's reads of
reply streams per second (one XREAD carries a flush's tokens for every stream it follows).
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import httpx
import redis
import typer

from sluice.bench.sse import sse_events
from sluice.supervisor.stack import LocalStack

MODELS = "models:\n  - name: echo\n    continuous_batching_config: {max_concurrent_batch_size: 256}\n"


def _cpu_s(pid: int) -> float:
    """User plus system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _calls(client: redis.Redis) -> dict[str, int]:
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in client.info("commandstats").items()}


async def _stream_one(http: httpx.AsyncClient, max_tokens: int) -> int:
    """Submit a request and follow its SSE stream to the end; the tokens its deltas carried."""
    r = await http.post("/v1/requests", json={"prompt": "tokens", "max_tokens": max_tokens})
    r.raise_for_status()
    tokens = 0
    async with http.stream("GET", f"/v1/requests/{r.json()['id']}/events") as response:
        async for ev in sse_events(response):
            if ev.event == "delta":
                tokens += len(ev.json()["text"].split())  # the null engine's tokens: " t<i>"
            elif ev.event in ("done", "error"):
                break
    return tokens


async def _load(url: str, streams: int, max_tokens: int, seconds: float) -> tuple[int, int, float]:
    """Keep `streams` streamed requests running for `seconds`; the tokens and requests done."""
    stop = time.monotonic() + seconds
    totals = [0, 0]
    limits = httpx.Limits(max_connections=2 * streams + 8)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        async def client() -> None:
            while time.monotonic() < stop:
                got = await _stream_one(http, max_tokens)  # (`totals[0] += await ...` reads totals[0] first)
                totals[0] += got
                totals[1] += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(streams)))
        return totals[0], totals[1], time.perf_counter() - t0


def tokens(
    streams: int = typer.Option(20, help="Streamed requests running at once."),
    token_ms: float = typer.Option(1.0, help="The null engine's time per token, per request."),
    max_tokens: int = typer.Option(500, help="Tokens per request."),
    seconds: float = typer.Option(20.0, help="How long the load runs."),
    out: Path = typer.Option(None, help="Write the figures as JSON here."),
) -> None:
    """Null engine: CPU per 1,000 streamed tokens in the worker and the api, and Redis writes per second."""
    env = {"SLUICE_LOG_LEVEL": "WARNING", "SLUICE_NULL_TOKEN_DELAY_S": str(token_ms / 1000)}
    with tempfile.TemporaryDirectory() as tmp, LocalStack(Path(tmp), MODELS, appendonly=False, env=env,
                                                          output="logs") as stack:
        stack.up(["echo"], engine="null", timeout_s=120)
        api, worker = next(iter(stack.apis.values())).pid, next(iter(stack.workers.values())).pid
        client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
        asyncio.run(_load(stack.url, 2, 8, 1.0))  # warm up: imports, connections, scripts loaded
        before = _calls(client), _cpu_s(worker), _cpu_s(api)
        delivered, requests, wall = asyncio.run(_load(stack.url, streams, max_tokens, seconds))
        after = _calls(client), _cpu_s(worker), _cpu_s(api)
        client.close()
    calls = {k: after[0].get(k, 0) - before[0].get(k, 0) for k in after[0]}
    # Scripts a request runs besides its token writes: admit, start, commit.
    reply_calls = calls.get("evalsha", 0) - 3 * requests
    figures = {
        "streams": streams, "token_ms": token_ms, "max_tokens": max_tokens, "wall_s": round(wall, 2),
        "requests": requests, "tokens": delivered,
        "tokens_per_s_asked": round(streams * 1000 / token_ms), "tokens_per_s": round(delivered / wall),
        "worker_cpu_ms_per_1000_tokens": round((after[1] - before[1]) * 1e6 / max(delivered, 1), 1),
        "api_cpu_ms_per_1000_tokens": round((after[2] - before[2]) * 1e6 / max(delivered, 1), 1),
        "worker_cpu_share": round((after[1] - before[1]) / wall, 2),
        "api_cpu_share": round((after[2] - before[2]) / wall, 2),
        "reply_script_calls_per_s": round(reply_calls / wall),
        "tokens_per_reply_call": round(delivered / max(reply_calls, 1), 1),
        "reply_reads_per_s": round(calls.get("xread", 0) / wall),
        "redis_commands_per_1000_tokens": round(sum(calls.values()) * 1000 / max(delivered, 1), 1),
    }
    typer.echo(json.dumps(figures, indent=2))
    if out:
        out.write_text(json.dumps(figures, indent=2))
