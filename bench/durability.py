"""`sluice bench durability`: what each durability setting costs and what it can lose.

For the default (`appendfsync everysec`) and strict (`appendfsync always`, plus WAITAOF on
servers that have it) settings, in the same run: the admissions per second one api sustains,
and how many requests that got a 202 are gone after Redis is killed with -9 in the middle
of a burst and restarted from its AOF. No worker runs, so every admitted request stays on
the stream and can be counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import redis as redis_sync
import typer

from sluice.broker.keys import ModelKeys
from sluice.supervisor.processes import EmbeddedRedis
from sluice.supervisor.stack import LocalStack

MODEL = "echo"
MODELS = f"models:\n  - name: {MODEL}\n    max_queued: 10000000\n"


@contextlib.contextmanager
def _api(strict: bool) -> Iterator[tuple[str, EmbeddedRedis]]:
    env = {"SLUICE_LOG_LEVEL": "ERROR", "SLUICE_DURABILITY": "strict" if strict else "default"}
    with tempfile.TemporaryDirectory() as tmp, LocalStack(Path(tmp), MODELS, strict=strict, env=env) as stack:
        url = stack.up([], timeout_s=60).url  # the api alone: nothing runs the requests
        assert stack.redis is not None
        yield url, stack.redis


async def _burst(url: str, seconds: float, concurrency: int, accepted: list[str],
                 stop: asyncio.Event | None = None) -> None:
    """Submit as fast as `concurrency` clients can until `seconds` pass (or `stop`)."""
    end = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        async def client_loop(k: int) -> None:
            i = 0
            while time.monotonic() < end and not (stop and stop.is_set()):
                i += 1
                try:
                    r = await client.post("/v1/requests", json={"prompt": f"c{k} r{i}", "max_tokens": 4})
                except httpx.HTTPError:
                    await asyncio.sleep(0.05)
                    continue
                if r.status_code == 202:
                    accepted.append(r.json()["id"])

        await asyncio.gather(*(client_loop(k) for k in range(concurrency)))


def _throughput(url: str, seconds: float, concurrency: int) -> float:
    accepted: list[str] = []
    asyncio.run(_burst(url, 1.0, concurrency, []))  # warm-up
    t0 = time.perf_counter()
    asyncio.run(_burst(url, seconds, concurrency, accepted))
    return len(accepted) / (time.perf_counter() - t0)


def _loss(url: str, redis: EmbeddedRedis, concurrency: int) -> tuple[int, int]:
    """kill -9 Redis 0.5 to 1.5 s into a burst; returns (acknowledged before the kill, lost)."""
    accepted: list[str] = []

    async def run() -> int:
        stop = asyncio.Event()
        burst = asyncio.create_task(_burst(url, 30, concurrency, accepted, stop))
        await asyncio.sleep(random.uniform(0.5, 1.5))
        redis.stop(kill=True)
        acknowledged = len(accepted)
        stop.set()
        await burst
        return acknowledged

    acknowledged = asyncio.run(run())
    redis.start()
    r = redis_sync.Redis.from_url(redis.url, decode_responses=True)
    keys = ModelKeys(MODEL)
    lost = sum(1 for rid in accepted[:acknowledged] if not r.exists(keys.status(rid)))
    r.flushall()
    return acknowledged, lost


def durability(
    seconds: float = typer.Option(5.0, help="Length of each throughput measurement."),
    concurrency: int = typer.Option(16, help="Clients submitting at once."),
    kills: int = typer.Option(3, help="kill -9 of Redis per setting."),
    out: Path = typer.Option(None, help="Write the figures as JSON here."),
) -> None:
    """Admissions/s and requests lost to a kill -9 of Redis, default vs strict durability."""
    figures: dict[str, dict] = {}
    for name, strict in (("default", False), ("strict", True)):
        with _api(strict) as (url, redis):
            rate = _throughput(url, seconds, concurrency)
            rounds = [_loss(url, redis, concurrency) for _ in range(kills)]
        figures[name] = {"admissions_per_s": round(rate, 1), "kills": kills,
                         "acknowledged_before_kill": sum(a for a, _ in rounds),
                         "lost": sum(lost for _, lost in rounds),
                         "lost_per_kill": [lost for _, lost in rounds]}
        typer.echo(f"{name}: {json.dumps(figures[name])}")
    figures["strict_vs_default_throughput"] = round(
        figures["strict"]["admissions_per_s"] / figures["default"]["admissions_per_s"], 3)
    typer.echo(json.dumps(figures, indent=2))
    if out:
        out.write_text(json.dumps(figures, indent=2))
