"""Watching is not owning, and an api's SIGTERM lets open streams finish (real processes).

A reader of /v1/requests/{id}/events that goes away cancels nothing and can come back with
Last-Event-ID; an OpenAI `stream: true` call owns its request and aborts it on disconnect.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis as redis_sync

from sluice.bench.sse import SseEvent, sse_events
from sluice.broker.keys import ModelKeys
from tests.e2e.conftest import NullStack, null_stack, submit, wait_done

MODEL = "disc"
MODELS = f"models:\n  - name: {MODEL}\n    continuous_batching_config: {{max_concurrent_batch_size: 8}}\n"
SLOW = {"SLUICE_NULL_TOKEN_DELAY_S": "0.05"}  # 20 tokens a second: generations outlive the disconnects


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NullStack]:
    with null_stack(tmp_path_factory.mktemp("disc"), MODELS, MODEL, **SLOW) as s:
        yield s


async def test_a_reader_that_disconnects_cancels_nothing_and_resumes(stack: NullStack) -> None:
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
        rid = await submit(client, MODEL, prompt="watch me", max_tokens=60)
        async with client.stream("GET", f"/v1/requests/{rid}/events") as r:
            # the reader goes away after its first event (`curl ... | head`)
            first = await anext(aiter(sse_events(r)))
        assert first.event == "delta" and first.id

        async with client.stream("GET", f"/v1/requests/{rid}/events", headers={"Last-Event-ID": first.id}) as r:
            rest = [ev async for ev in sse_events(r)]
        final = await wait_done(client, rid)
    assert final["status"] == "done" and rest[-1].event == "done"
    deltas = [first, *rest[:-1]]
    assert [e.json()["index"] for e in deltas] == sorted({e.json()["index"] for e in deltas})
    assert "".join(e.json()["text"] for e in deltas) == final["output"]["text"]


async def test_an_openai_stream_that_disconnects_aborts_its_request(stack: NullStack) -> None:
    body = {"model": MODEL, "prompt": "own me", "max_tokens": 2000, "stream": True}  # ~100 s uncancelled
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for ev in sse_events(r):
                chunk = ev.json()
                if chunk["choices"][0]["text"]:
                    break  # the client goes away mid-generation
        rid = "req-" + chunk["id"].removeprefix("cmpl-")
        final = await wait_done(client, rid, timeout_s=60)
    assert final["status"] == "cancelled"  # aborted mid-generation (its partial output is kept)


async def _refused(url: str, timeout_s: float = 30) -> None:
    """Until a new connection to `url` is refused (or, caught in the listening socket's backlog
    as uvicorn closed it, dropped without a response: not served either)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            async with httpx.AsyncClient(base_url=url, timeout=5) as fresh:
                await fresh.get("/healthz")
        except (httpx.ConnectError, httpx.RemoteProtocolError):
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"{url} still accepts connections")


async def test_sigterm_lets_open_streams_finish(tmp_path: Path) -> None:
    with null_stack(tmp_path, MODELS, MODEL, SLUICE_SHUTDOWN_TIMEOUT_S="60", **SLOW) as stack:
        api = stack.procs["api"]
        events: list[SseEvent] = []
        async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
            rid = await submit(client, MODEL, prompt="finish me", max_tokens=100)
            async with client.stream("GET", f"/v1/requests/{rid}/events") as r:
                async for ev in sse_events(r):
                    events.append(ev)
                    if len(events) == 1:  # mid-generation: a rolling restart reaches this api
                        api.send_signal(signal.SIGTERM)
                        await _refused(stack.url)
        assert [e.event for e in events[:-1]] == ["delta"] * (len(events) - 1)
        assert events[-1].event == "done", [e.event for e in events]
        text = "".join(e.json()["text"] for e in events[:-1])
        assert text == events[-1].json()["output"]["text"] and events[-1].json()["status"] == "done"
        # uvicorn re-raises the signal it caught once it has shut down
        assert await asyncio.to_thread(api.wait, 30) == -signal.SIGTERM
        with redis_sync.Redis.from_url(stack.redis.url, decode_responses=True) as r:
            assert r.hget(ModelKeys(MODEL).status(rid), "state") == "done"



async def test_an_idle_connection_outlives_the_clients_keep_alive(stack: NullStack) -> None:
    """httpx and the OpenAI SDK reuse a pooled connection for up to 5 s idle: an api that closed
    it at 5 s (uvicorn's default) raced the reuse ("Server disconnected without sending a
    response"). The api holds it longer, so the client closes first: a client keeping its
    connections longer than 5 s still finds the one it used 6 s ago open (a closed one it
    replaces with a new connection, from another local port)."""
    def local(r: httpx.Response) -> tuple:
        return r.extensions["network_stream"].get_extra_info("client_addr")

    limits = httpx.Limits(max_connections=1, keepalive_expiry=30)
    async with httpx.AsyncClient(base_url=stack.url, timeout=10, limits=limits) as client:
        first = await client.get("/healthz")
        used = local(first)
        await asyncio.sleep(6)  # past the clients' 5 s, well within the api's 65 s
        again = await client.get("/healthz")
        assert first.status_code == again.status_code == 200
        assert local(again) == used
