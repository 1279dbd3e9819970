"""Each key holds at most max_streams_per_key open SSE streams per api process (issue 29,
finding 11): one more, of any kind (/events, an OpenAI stream, a Responses stream), is a 429
that queues nothing; other keys are not affected, and a slot is given back when its stream
ends. Through a real server (an in-process ASGI client would wait for a stream's end)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from sluice.broker.keys import ModelKeys
from sluice.config.settings import Settings
from tests.api.keyed_app import ALICE, BOB, keyed_app
from tests.api.test_slow_clients import serving
from tests.broker.helpers import MODEL

CAP = 3


@pytest.fixture
async def base_url(redis: Redis, settings: Settings, tmp_path: Path) -> AsyncIterator[str]:
    # `redis` first: its database is flushed before the app deploys into it
    async with keyed_app(settings, tmp_path, max_streams_per_key=CAP, max_wait_s=0.2) as app, \
            serving(app, app.state.sluice.settings) as (host, port):
        yield f"http://{host}:{port}"


def as_key(base_url: str, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30)


STREAMS = {  # how a key opens a stream of each kind: (method, path, json), {rid} filled in
    "events": ("GET", "/v1/requests/{rid}/events", None),
    "completions": ("POST", "/v1/completions", {"model": MODEL, "prompt": "p", "stream": True}),
    "chat": ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "p"}],
                                              "stream": True}),
    "responses": ("POST", "/v1/responses", {"model": MODEL, "input": "p", "stream": True}),
}


async def open_stream(stack: AsyncExitStack, client: httpx.AsyncClient, kind: str, rid: str) -> httpx.Response:
    method, path, body = STREAMS[kind]
    return await stack.enter_async_context(client.stream(method, path.format(rid=rid), json=body))


async def queued(redis: Redis) -> int:
    return await redis.xlen(ModelKeys(MODEL).requests)


@pytest.mark.parametrize("kinds", [("events", "events", "events", "completions"),
                                   ("completions", "chat", "responses", "events"),
                                   ("responses", "events", "chat", "responses")])
async def test_one_stream_over_the_cap_is_a_429_that_queues_nothing(base_url: str, redis: Redis,
                                                                    kinds: tuple[str, ...]) -> None:
    async with as_key(base_url, ALICE) as alice, as_key(base_url, BOB) as bob, AsyncExitStack() as stack:
        rid = (await alice.post("/v1/requests", json={"model": MODEL, "prompt": "p"})).json()["id"]
        held = [await open_stream(stack, alice, kind, rid) for kind in kinds[:CAP]]
        assert [r.status_code for r in held] == [200] * CAP
        before = await queued(redis)
        for kind in STREAMS:
            method, path, body = STREAMS[kind]
            async with alice.stream(method, path.format(rid=rid), json=body) as refused:
                assert refused.status_code == 429, kind  # before reading: an open stream would not end
                await refused.aread()
                assert "SLUICE_MAX_STREAMS_PER_KEY" in refused.json()["error"]["message"]
        assert await queued(redis) == before
        theirs = await open_stream(stack, bob, kinds[-1], (await bob.post(
            "/v1/requests", json={"model": MODEL, "prompt": "p"})).json()["id"])
        assert theirs.status_code == 200  # another key's streams are its own
        await held[0].aclose()  # a stream that ends gives its slot back (once the server sees it)
        async with asyncio.timeout(15):
            while True:
                again = await open_stream(stack, alice, kinds[-1], rid)
                if again.status_code == 200:
                    break
                await again.aclose()
                await asyncio.sleep(0.05)


async def test_requests_that_are_not_streams_are_not_counted(base_url: str) -> None:
    async with as_key(base_url, ALICE) as alice, AsyncExitStack() as stack:
        rid = (await alice.post("/v1/requests", json={"model": MODEL, "prompt": "p"})).json()["id"]
        for _ in range(CAP):
            await open_stream(stack, alice, "events", rid)
        r = await alice.post("/v1/completions", json={"model": MODEL, "prompt": "p", "max_tokens": 1})
        assert r.status_code == 504  # no worker: it waited for its result, it was not refused
