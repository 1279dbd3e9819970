"""Cancels started where nothing can await them are owned by the app state: kept until done,
and the lifespan lets them reach Redis before it closes its client."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from redis.asyncio import Redis

from sluice.api.cancels import BackgroundCancels
from tests.api.conftest import StartApi, http_client
from tests.broker.helpers import KEYS


class SlowCancels:
    """Stands for Cancels: each cancel waits for `release`, or for ever."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.cancelled: list[str] = []

    async def cancel(self, model: str, rid: str) -> str:
        await self.release.wait()
        self.cancelled.append(rid)
        return "cancelled"


async def test_drain_waits_for_the_cancels_under_way() -> None:
    slow = SlowCancels()
    cancels = BackgroundCancels(slow)  # type: ignore[arg-type]
    cancels.soon("m", "req-1")
    cancels.soon("m", "req-2")
    assert cancels.pending == 2
    asyncio.get_running_loop().call_soon(slow.release.set)
    await cancels.drain(timeout_s=30)
    assert sorted(slow.cancelled) == ["req-1", "req-2"] and cancels.pending == 0


async def test_drain_gives_up_on_a_cancel_that_never_ends() -> None:
    cancels = BackgroundCancels(SlowCancels())  # type: ignore[arg-type]
    cancels.soon("m", "req-stuck")
    await cancels.drain(timeout_s=0.01)  # returns, with the stuck cancel itself cancelled
    assert cancels.pending == 0
    await cancels.drain(timeout_s=0.01)  # nothing under way: at once


async def test_the_lifespan_lets_a_cancel_reach_redis(start_api: StartApi, redis: Redis) -> None:
    async with start_api() as app:
        async with http_client(app) as api:
            rid = (await api.post("/v1/requests", json={"prompt": "p", "max_tokens": 2})).json()["id"]
        _app_state(app).cancels.soon(KEYS.model, rid)  # as an OpenAI stream torn down at shutdown does
    assert await redis.hget(KEYS.status(rid), "state") == "cancelled"


def _app_state(app: FastAPI):  # type: ignore[no-untyped-def]
    return app.state.sluice
