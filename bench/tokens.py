"""`sluice bench tokens`: the per-token path at GPU rates, with the null engine.

`--streams` requests are kept running at once, each streaming one token every `--token-ms`
(64 × 5 ms asks for 12,800 tokens/s; what this machine delivers is reported against it), each
submitted and followed over SSE on plain sockets (the load generator must not take the cores
it measures, nor wait in a connection pool of its own), for `--seconds`. Reported: delivered ÷
asked, from the tokens that came within those seconds (see _load: the clients start spread
over a request's time, and the seconds counted are those while all of them run); the median time
from submitting a request to its first token; the CPU time the api, the worker
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
import statistics
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

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


async def _submit(url: str, max_tokens: int) -> str:
    """Submit a request on a plain socket of its own; its id. (httpx's connection pool, shared by
    hundreds of clients, held each request up to a second at 256 streams: the load generator's
    own wait, which the figures must not count.)"""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        body = json.dumps({"prompt": "tokens", "max_tokens": max_tokens}).encode()
        writer.write(f"POST /v1/requests HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                     "Connection: close\r\n\r\n".encode() + body)
        answer = await reader.read()
    finally:
        writer.close()
    head, _, rest = answer.partition(b"\r\n\r\n")
    if b" 202 " not in head.split(b"\r\n", 1)[0]:
        raise RuntimeError(f"submitting failed: {answer[:500]!r}")
    return json.loads(rest)["id"]


async def _stream_one(url: str, max_tokens: int, window: tuple[float, float]) -> tuple[int, int, float]:
    """Submit a request and follow its SSE stream to its end: the tokens its deltas carried, those
    of them that came within `window` (monotonic times), and the time from submitting to its
    first token. The stream's bytes are searched, not parsed event by event: at 12,800 tokens a
    second a client in Python would take a core this machine's servers need (what the events
    hold is checked by `sluice bench streams` and the tests)."""
    submitted = time.monotonic()
    reader, writer = await open_sse(url, await _submit(url, max_tokens))
    body, start, first = bytearray(), 0, None
    at = [0, 0]  # how much of the body had come by the window's start, and by its end
    try:
        while not (end := _END.search(body, start)):
            start = max(0, len(body) - 32)  # (a match may straddle two reads)
            got = await reader.read(65536)
            if not got:
                raise RuntimeError("the stream ended before its final event")
            now = time.monotonic()
            if first is None and _TOKEN.search(got):
                first = now - submitted
            body += got
            for k, edge in enumerate(window):
                if now < edge:
                    at[k] = len(body)
    finally:
        writer.close()
    # the deltas' tokens (the final repeats them all)
    before, by_end = (len(_TOKEN.findall(body, 0, min(n, end.start()))) for n in at)
    return len(_TOKEN.findall(body, 0, end.start())), by_end - before, first or 0.0


async def _load(url: str, streams: int, max_tokens: int, seconds: float, ramp_s: float) -> dict[str, float]:
    """Keep `streams` streamed requests running for `seconds` after a ramp: the tokens and requests
    done, the tokens that came within those seconds, and the median time from submitting to a
    first token. The clients start one after another over `ramp_s` (a request's time), so that
    their requests start and end spread out, as independent clients' do: started together, with
    every request as long, they would stay in step, and hundreds of them submit in one burst
    every request's time. The seconds counted are those while every stream was running (the
    last requests, which end after them, run fewer at once)."""
    t0 = time.monotonic()
    window = (t0 + ramp_s, t0 + ramp_s + seconds)
    totals = {"tokens": 0, "requests": 0, "in_window": 0}
    firsts: list[float] = []

    async def client(k: int) -> None:
        await asyncio.sleep(ramp_s * k / streams)
        while time.monotonic() < window[1]:
            got, in_window, first = await _stream_one(url, max_tokens, window)
            totals["tokens"] += got
            totals["in_window"] += in_window
            totals["requests"] += 1
            firsts.append(first)

    await asyncio.gather(*(client(k) for k in range(streams)))
    return {**totals, "wall_s": time.monotonic() - t0, "first_token_s": statistics.median(firsts)}


def _reply_calls(port: int) -> float:
    """The worker's reply.lua calls so far (its Prometheus counter)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sluice_reply_script_calls_total"))


def _per_1000(cpu_s: float, tokens: float) -> float:
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
        assert stack.redis_url is not None  # up() started Redis
        client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
        asyncio.run(_load(stack.url, 2, 8, 1.0, 0.0))  # warm up: imports, connections, scripts loaded
        load_average = os.getloadavg()[0]
        before = _calls(client), cpu_s(worker), cpu_s(api), _redis_cpu_s(client), _reply_calls(metrics)
        load = asyncio.run(_load(stack.url, streams, max_tokens, seconds, max_tokens * token_ms / 1000))
        after = _calls(client), cpu_s(worker), cpu_s(api), _redis_cpu_s(client), _reply_calls(metrics)
        client.close()
    calls = {k: after[0].get(k, 0) - before[0].get(k, 0) for k in after[0]}
    reply_calls = after[4] - before[4]
    asked = streams * 1000 / token_ms
    delivered, wall = load["tokens"], load["wall_s"]
    figures = {
        "streams": streams, "token_ms": token_ms, "max_tokens": max_tokens, "seconds": seconds,
        "wall_s": round(wall, 2), "load_average_1m": round(load_average, 2), "requests": load["requests"],
        "tokens": delivered, "tokens_in_window": load["in_window"],
        "tokens_per_s_asked": round(asked), "tokens_per_s": round(load["in_window"] / seconds),
        "delivered_of_asked": round(load["in_window"] / seconds / asked, 3),
        "submit_to_first_token_ms_p50": round(load["first_token_s"] * 1000, 1),
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
