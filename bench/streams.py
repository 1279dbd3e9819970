"""`sluice bench streams`: many open SSE streams on one api process, and what they cost it:
memory per open stream, and the Redis connections the api holds (its reply router follows
every stream on a few shared connections).

The requests are admitted with no worker running, so every stream is open and waiting; the
api's memory and connections are read then. A null-engine worker then runs them all and
every stream must end with its `done` event.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import redis
import typer

from sluice.bench.sse import aevents
from sluice.supervisor.stack import LocalStack

MODELS = "models:\n  - name: echo\n    continuous_batching_config: {max_concurrent_batch_size: 256}\n"


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _api_connections(client: redis.Redis) -> int:
    return sum(1 for c in client.client_list() if c.get("name", "").startswith("sluice-api"))


async def _submit(url: str, n: int) -> list[str]:
    sem = asyncio.Semaphore(64)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def one(i: int) -> str:
            async with sem:
                r = await client.post("/v1/requests", json={"prompt": f"stream {i}", "max_tokens": 4})
                r.raise_for_status()
                return r.json()["id"]

        return list(await asyncio.gather(*(one(i) for i in range(n))))


async def open_sse(url: str, rid: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """An SSE stream on a plain socket (lighter than an HTTP client per stream), past its headers."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    writer.write(f"GET /v1/requests/{rid}/events HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                 "Accept: text/event-stream\r\n\r\n".encode())
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    if b" 200 " not in head.split(b"\r\n", 1)[0]:
        raise RuntimeError(f"{rid}: {head[:80]!r}")
    return reader, writer


async def _until_done(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    try:
        # The body is chunked: each event comes in one chunk, and the chunk-size lines between
        # them read as fields no server-sent-events reader knows, which it ignores.
        async for ev in aevents(reader):
            if ev.event == "done":
                return True
        return False
    finally:
        writer.close()


async def _run(stack: LocalStack, n: int, client: redis.Redis) -> dict:
    url = stack.url
    api_pid = next(iter(stack.apis.values())).pid
    rids = await _submit(url, n)
    before_mib = _rss_mib(api_pid)
    t0 = time.perf_counter()
    sem = asyncio.Semaphore(256)  # connections being opened at once (the listen backlog)

    async def opened(rid: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        async with sem:
            return await open_sse(url, rid)

    streams = await asyncio.gather(*(opened(rid) for rid in rids))
    open_s = time.perf_counter() - t0
    await asyncio.sleep(2)  # every stream past its first read
    held = {"api_rss_mib": _rss_mib(api_pid), "api_redis_connections": _api_connections(client)}
    peak = [held["api_redis_connections"]]

    async def sample() -> None:
        while True:
            peak.append(await asyncio.to_thread(_api_connections, client))
            await asyncio.sleep(0.5)

    sampler = asyncio.create_task(sample())
    t0 = time.perf_counter()
    stack.start_worker("echo", engine="null")
    done = await asyncio.gather(*(_until_done(r, w) for r, w in streams))
    drain_s = time.perf_counter() - t0
    sampler.cancel()
    return {
        "streams": n, "opened_in_s": round(open_s, 2),
        "api_rss_mib_before": round(before_mib, 1), "api_rss_mib_with_streams": round(held["api_rss_mib"], 1),
        "kib_per_open_stream": round((held["api_rss_mib"] - before_mib) * 1024 / n, 1),
        "api_redis_connections_while_held": held["api_redis_connections"],
        "api_redis_connections_peak": max(peak),
        "streams_done": sum(done), "all_done_in_s": round(drain_s, 2),
    }


def streams(
    n: int = typer.Option(10_000, "--streams", help="SSE streams held open at once."),
    out: Path = typer.Option(None, help="Write the figures as JSON here."),
    logs: Path = typer.Option(None, help="Keep the processes' logs in this folder."),
) -> None:
    """Null engine: N SSE streams open on one api process; its memory per stream and Redis connections."""
    env = {"SLUICE_LOG_LEVEL": "WARNING", "SLUICE_MAX_QUEUED": str(n + 100)}
    with tempfile.TemporaryDirectory() as tmp, LocalStack(Path(tmp), MODELS, appendonly=False, env=env,
                                                          output="logs", logs_dir=logs) as stack:
        stack.up([], timeout_s=60)
        assert stack.redis_url is not None  # up() started Redis
        client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
        figures = asyncio.run(_run(stack, n, client))
        client.close()
    typer.echo(json.dumps(figures, indent=2))
    if out:
        out.write_text(json.dumps(figures, indent=2))
    if figures["streams_done"] != n:
        raise typer.Exit(1)
