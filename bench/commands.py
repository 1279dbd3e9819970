"""Redis commands per request, as `INFO commandstats` counts them (the commands that Lua
scripts run included): what one non-streamed and one streamed request cost the queue."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import aiohttp
import redis

from sluice.bench.sse import aevents


def commandstats(client: redis.Redis) -> Counter[str]:
    """Calls per command since the last CONFIG RESETSTAT (INFO and CONFIG themselves left out)."""
    stats = client.info("commandstats")
    return Counter({name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()
                    if name.split("_", 1)[1].split("|")[0] not in ("info", "config")})


async def _requests(url: str, n: int, concurrency: int, streamed: bool, max_tokens: int) -> None:
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as client:
        async def one(i: int) -> None:
            async with sem:
                body = {"prompt": f"count {i}", "max_tokens": max_tokens}
                if not streamed:
                    async with client.post(f"{url}/v1/requests", json=body,
                                           headers={"Prefer": "wait=60"}) as r:
                        text = await r.text()
                        assert r.status == 200 and json.loads(text)["status"] == "done", text
                    return
                async with client.post(f"{url}/v1/requests", json=body) as r:
                    rid = (await r.json())["id"]
                async with client.get(f"{url}/v1/requests/{rid}/events") as events:
                    async for ev in aevents(events.content):
                        if ev.event == "done":
                            return
                raise AssertionError(f"{rid}: the stream ended without its final")

        await asyncio.gather(*(one(i) for i in range(n)))


def per_request(url: str, redis_url: str, *, requests: int = 200, concurrency: int = 8,
                streamed: bool = False, max_tokens: int = 16) -> dict:
    """Commands per request over `requests` requests (`concurrency` at once): the total and the
    ten largest shares, per command. Everything Redis ran meanwhile is counted (heartbeats,
    housekeeping, idle reads): that is what the queue costs under this load."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    # a warm-up: scripts loaded, pools warm
    asyncio.run(_requests(url, min(requests, 20), concurrency, streamed, max_tokens))
    client.config_resetstat()
    asyncio.run(_requests(url, requests, concurrency, streamed, max_tokens))
    calls = commandstats(client)
    client.close()
    return {"streamed": streamed, "requests": requests, "max_tokens": max_tokens,
            "commands_per_request": round(sum(calls.values()) / requests, 2),
            "by_command": {name: round(n / requests, 2) for name, n in calls.most_common(10)}}
