"""`sluice bench tokens`: the per-token path at GPU rates, with the null engine.

`--streams` requests are kept running at once, each streaming one token every `--token-ms`
(64 × 5 ms asks for 12,800 tokens/s; what this machine delivers is reported against it), each
followed by a client over SSE (a plain socket: the load generator must not take the cores it
measures), for `--seconds`. Reported: delivered ÷ asked; the CPU time the api, the worker
(from /proc) and the Redis server (`INFO CPU`) spent per 1,000 tokens (their whole work:
admission, start, commit and the SSE stream of each request included, so long requests keep
that share small); Redis commands per token (`INFO commandstats`, the commands scripts run
included); and what the token path cost in script calls: the reply script's calls per second
and tokens per call (the worker writes what every request generated since its last write in
one call per shard of the model; its calls from its metrics).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import tempfile
import time
from pathlib import Path

import httpx
import redis
import typer

from sluice.bench.frontend_cpu import cpu_s
from sluice.bench.streams import open_sse
from sluice.supervisor.processes import free_port
from sluice.supervisor.stack import LocalStack

MODELS = "models:\n  - name: echo\n    continuous_batching_config: {max_concurrent_batch_size: 256}\n"


def _calls(client: redis.Redis) -> dict[str, int]:
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in client.info("commandstats").items()}


def _redis_cpu_s(client: redis.Redis) -> float:
    cpu = client.info("cpu")
    return float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])


_TOKEN = re.compile(rb" t[0-9]+")  # the null engine's tokens: " t<i>"
_END = re.compile(rb"\r?\nevent: (?:done|error)\r?\n")


async def _stream_one(url: str, http: httpx.AsyncClient, max_tokens: int) -> int:
    """Submit a request and follow its SSE stream to its end; the tokens its deltas carried.
    The stream's bytes are searched, not parsed event by event: at 12,800 tokens a second a
    client in Python would take a core this machine's servers need (what the events hold
    is checked by `sluice bench streams` and the tests)."""
    r = await http.post("/v1/requests", json={"prompt": "tokens", "max_tokens": max_tokens})
    r.raise_for_status()
    reader, writer = await open_sse(url, r.json()["id"])
    body, start = bytearray(), 0
    try:
        while not (end := _END.search(body, start)):
            start = max(0, len(body) - 32)  # (a match may straddle two reads)
            got = await reader.read(65536)
            if not got:
                raise RuntimeError("the stream ended before its final event")
            body += got
    finally:
        writer.close()
    return len(_TOKEN.findall(body, 0, end.start()))  # the deltas' tokens (the final repeats them all)


async def _load(url: str, streams: int, max_tokens: int, seconds: float) -> tuple[int, int, float]:
    """Keep `streams` streamed requests running for `seconds`; the tokens and requests done."""
    stop = time.monotonic() + seconds
    totals = [0, 0]
    limits = httpx.Limits(max_connections=streams + 8)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        async def client() -> None:
            while time.monotonic() < stop:
                got = await _stream_one(url, http, max_tokens)  # (`totals[0] += await ...` reads totals[0] first)
                totals[0] += got
                totals[1] += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(streams)))
        return totals[0], totals[1], time.perf_counter() - t0


def _reply_calls(port: int) -> float:
    """The worker's reply.lua calls so far (its Prometheus counter)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sluice_reply_script_calls_total"))


def _per_1000(cpu_s: float, tokens: int) -> float:
    return round(cpu_s * 1e6 / max(tokens, 1), 1)


def tokens(
    streams: int = typer.Option(20, help="Streamed requests running at once."),
    token_ms: float = typer.Option(1.0, help="The null engine's time per token, per request."),
    max_tokens: int = typer.Option(500, help="Tokens per request."),
    seconds: float = typer.Option(20.0, help="How long the load runs."),
    out: Path = typer.Option(None, help="Write the figures as JSON here."),
) -> None:
    """Null engine: delivered ÷ asked, and CPU per 1,000 streamed tokens in the api, the worker and Redis."""
    metrics = free_port()  # the worker's: its reply-script calls
    env = {"SLUICE_LOG_LEVEL": "WARNING", "SLUICE_NULL_TOKEN_DELAY_S": str(token_ms / 1000),
           "SLUICE_WORKER_METRICS_PORT": str(metrics)}
    with tempfile.TemporaryDirectory() as tmp, LocalStack(Path(tmp), MODELS, appendonly=False, env=env,
                                                          output="logs") as stack:
        stack.up(["echo"], engine="null", timeout_s=120)
        api, worker = next(iter(stack.apis.values())).pid, next(iter(stack.workers.values())).pid
        client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
        asyncio.run(_load(stack.url, 2, 8, 1.0))  # warm up: imports, connections, scripts loaded
        load = os.getloadavg()[0]
        before = _calls(client), cpu_s(worker), cpu_s(api), _redis_cpu_s(client), _reply_calls(metrics)
        delivered, requests, wall = asyncio.run(_load(stack.url, streams, max_tokens, seconds))
        after = _calls(client), cpu_s(worker), cpu_s(api), _redis_cpu_s(client), _reply_calls(metrics)
        client.close()
    calls = {k: after[0].get(k, 0) - before[0].get(k, 0) for k in after[0]}
    reply_calls = after[4] - before[4]
    asked = streams * 1000 / token_ms
    figures = {
        "streams": streams, "token_ms": token_ms, "max_tokens": max_tokens, "wall_s": round(wall, 2),
        "load_average_1m": round(load, 2), "requests": requests, "tokens": delivered,
        "tokens_per_s_asked": round(asked), "tokens_per_s": round(delivered / wall),
        "delivered_of_asked": round(delivered / wall / asked, 3),
        "api_cpu_ms_per_1000_tokens": _per_1000(after[2] - before[2], delivered),
        "worker_cpu_ms_per_1000_tokens": _per_1000(after[1] - before[1], delivered),
        "redis_cpu_ms_per_1000_tokens": _per_1000(after[3] - before[3], delivered),
        "api_cpu_share": round((after[2] - before[2]) / wall, 2),
        "worker_cpu_share": round((after[1] - before[1]) / wall, 2),
        "redis_cpu_share": round((after[3] - before[3]) / wall, 2),
        "redis_commands_per_token": round(sum(calls.values()) / max(delivered, 1), 2),
        "reply_script_calls_per_s": round(reply_calls / wall),
        "tokens_per_reply_call": round(delivered / max(reply_calls, 1), 1),
        "reply_reads_per_s": round(calls.get("xread", 0) / wall),
    }
    typer.echo(json.dumps(figures, indent=2))
    if out:
        out.write_text(json.dumps(figures, indent=2))
