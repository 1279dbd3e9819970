"""SSE readers of /v1/requests/{id}/events: every stream ends, and Last-Event-ID is checked.

The api runs in-process. httpx's ASGITransport answers only once the app has finished the
response, so a stream that never ends would hang the test: each read is bounded.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI
from redis.asyncio import Redis

from sluice.bench.sse import SseEvent, SseParser, parse, sse_events
from sluice.config.settings import Settings
from sluice.protocol.messages import DeltaEvent
from sluice.workers.worker import Worker
from tests.api.conftest import StartApi, http_client
from tests.broker.helpers import KEYS, done_result, running_request
from tests.fakes import eventually

IDLE_S = 1.0
READ_LIMIT_S = 15.0  # far above IDLE_S: reaching it means the stream did not end


@pytest.fixture
async def api(start_api: StartApi) -> AsyncIterator[httpx.AsyncClient]:
    async with start_api(sse_idle_timeout_s=IDLE_S) as app, http_client(app) as client:
        yield client


async def read(api: httpx.AsyncClient, rid: str, last_event_id: str | None = None) -> httpx.Response:
    headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
    return await asyncio.wait_for(api.get(f"/v1/requests/{rid}/events", headers=headers), READ_LIMIT_S)


async def add_delta(redis: Redis, rid: str, delta: DeltaEvent) -> None:
    await redis.xadd(KEYS.reply(rid), {"kind": "delta", "data": delta.model_dump_json()})


async def events_of(response: httpx.Response) -> list[SseEvent]:
    assert response.status_code == 200, response.text
    return [ev async for ev in sse_events(response)]


def comments_of(response: httpx.Response) -> list[str]:
    parse(response.text, parser := SseParser())
    return parser.comments


async def test_final_comes_from_the_status_when_the_reply_stream_expired(
        api: httpx.AsyncClient, redis: Redis, settings: Settings) -> None:
    _, m, c, d = await running_request(redis, settings)
    assert await c.commit(d, done_result(" a b"))
    await redis.delete(KEYS.reply(m.id))  # what its TTL does an hour after the final

    events = await events_of(await read(api, m.id))
    assert [e.event for e in events] == ["done"]
    assert events[0].json()["status"] == "done" and events[0].json()["output"]["text"] == " a b"


async def test_reconnecting_at_the_final_event_gets_the_final_again(
        api: httpx.AsyncClient, redis: Redis, settings: Settings) -> None:
    _, m, c, d = await running_request(redis, settings)
    assert await c.commit(d, done_result())
    (first,) = await events_of(await read(api, m.id))
    assert first.event == "done" and first.id

    # A browser's EventSource reconnects when the server closes, sending the final's id.
    (again,) = await events_of(await read(api, m.id, last_event_id=first.id))
    assert again.event == "done" and again.json() == first.json()


async def test_a_silent_stream_closes_with_a_comment_and_resumes_from_last_event_id(
        api: httpx.AsyncClient, redis: Redis, settings: Settings) -> None:
    _, m, c, d = await running_request(redis, settings)
    await add_delta(redis, m.id, DeltaEvent(i=0, text=" a", token_ids=[1]))

    response = await read(api, m.id)  # one delta, then nothing for longer than the idle timeout
    (delta,) = await events_of(response)
    assert delta.event == "delta" and delta.json()["text"] == " a"
    comments = comments_of(response)
    assert comments and "Last-Event-ID" in comments[-1]

    await add_delta(redis, m.id, DeltaEvent(i=1, text=" b", token_ids=[2]))
    assert await c.commit(d, done_result(" a b"))
    rest = await events_of(await read(api, m.id, last_event_id=delta.id))
    assert [(e.event, e.json().get("text")) for e in rest] == [("delta", " b"), ("done", None)]


async def test_a_queued_request_with_no_event_closes_after_the_idle_timeout(api: httpx.AsyncClient) -> None:
    r = await api.post("/v1/requests", json={"prompt": "nobody serves this", "max_tokens": 2})
    assert r.status_code == 202, r.text
    response = await read(api, r.json()["id"])
    assert await events_of(response) == []
    assert comments_of(response)
    status = await api.get(f"/v1/requests/{r.json()['id']}")
    assert status.json()["status"] == "queued"  # closing the stream cancelled nothing


@pytest.mark.parametrize("bad", ["x", "1-x", "-1", "1-2-3", "99999999999999999999999-0"])
async def test_a_last_event_id_that_is_no_event_id_is_a_400_naming_the_header(
        api: httpx.AsyncClient, redis: Redis, settings: Settings, bad: str) -> None:
    _, m, _, _ = await running_request(redis, settings)
    r = await read(api, m.id, last_event_id=bad)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "Last-Event-ID"
    assert "Last-Event-ID" in r.json()["error"]["message"]


async def test_last_event_id_is_in_the_openapi_document(api: httpx.AsyncClient) -> None:
    spec = (await api.get("/openapi.json")).json()
    params = spec["paths"]["/v1/requests/{rid}/events"]["get"]["parameters"]
    assert ("Last-Event-ID", "header") in [(p["name"], p["in"]) for p in params]


@pytest.mark.parametrize("seed", range(3))
async def test_last_event_id_resumes_a_multi_row_stream_after_any_of_its_events(
        api: httpx.AsyncClient, redis: Redis, settings: Settings, seed: int) -> None:
    """Issue 28, defect 6: resuming after any event of a stream whose rows' deltas interleave
    gives exactly the events after it, for every row. The resume index of the last event's own
    row used to be filed under row 0, so row 0's next tokens were dropped (and another row's
    replayed tokens shown again)."""
    rng = random.Random(seed)
    _, m, c, d = await running_request(redis, settings)
    next_i = [0, 0, 0]
    for n in range(18):
        row, size = rng.randrange(3), rng.randint(1, 3)
        ids = list(range(next_i[row], next_i[row] + size))
        await add_delta(redis, m.id, DeltaEvent(i=ids[0], text=f" r{row}.{n}", token_ids=ids, row=row))
        next_i[row] += size
        if rng.random() < 0.2:  # a retry replaying tokens already on the stream: no reader shows them
            await add_delta(redis, m.id, DeltaEvent(i=0, text=" again", token_ids=[0], row=rng.randrange(3)))
    assert await c.commit(d, done_result())

    whole = await events_of(await read(api, m.id))
    assert [e.event for e in whole] == ["delta"] * 18 + ["done"]
    wrong = []
    for k, last in enumerate(whole[:-1]):
        rest = await events_of(await read(api, m.id, last_event_id=last.id))
        if [(e.event, e.data) for e in rest] != [(e.event, e.data) for e in whole[k + 1:]]:
            wrong.append((k, last.data, [e.data for e in rest][:3]))
    assert not wrong, wrong


@pytest.mark.parametrize("seed", range(2))
async def test_three_readers_of_each_of_many_streamed_requests_each_get_the_final_text(
        app: FastAPI, null_worker: Worker, redis: Redis, seed: int) -> None:
    """Issue 28, defect 1, through the api with a null-engine worker: requests streamed at once,
    each read over /events by a reader from the start, one that joins once a random number of
    entries is on its reply stream, and one that resumes with Last-Event-ID after a random entry
    written so far (as a reconnecting EventSource does). Every reader's deltas join to exactly
    the final text from where it began. Readers joining while the api's reply router had a read
    under way for their stream used to skip tokens."""
    rng = random.Random(seed)
    tokens = 24
    async with http_client(app) as api:

        async def read(rid: str, last_event_id: str | None = None) -> tuple[str, str]:
            headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
            r = await asyncio.wait_for(api.get(f"/v1/requests/{rid}/events", headers=headers), 60)
            events = await events_of(r)
            assert events[-1].event == "done", events[-1]
            return "".join(e.json()["text"] for e in events[:-1]), events[-1].json()["output"]["text"]

        async def entries(rid: str, k: int) -> list[tuple[str, dict]]:
            got: list = []

            async def enough() -> bool:
                got[:] = await redis.xrange(KEYS.reply(rid))
                return len(got) >= k or bool(got) and got[-1][1]["kind"] == "final"  # (deltas come joined)

            await eventually(enough, timeout_s=60, interval_s=0.005, what=f"{k} entries or the final on {rid}'s stream")
            return got

        async def late(rid: str) -> tuple[str, str]:
            await entries(rid, rng.randint(0, tokens))
            return await read(rid)

        async def resumed(rid: str) -> tuple[str, str]:
            got = await entries(rid, rng.randint(1, tokens))
            n = rng.randrange(len(got))
            seen = "".join(json.loads(f["data"])["text"] for _, f in got[:n + 1] if f["kind"] == "delta")
            rest, final = await read(rid, last_event_id=got[n][0])
            return seen + rest, final

        rids = []
        for n in range(16):
            r = await api.post("/v1/requests", json={"prompt": f"p{seed}.{n}", "max_tokens": tokens})
            assert r.status_code == 202, r.text
            rids.append(r.json()["id"])
        readers = [(kind, rid, asyncio.create_task(f(rid))) for rid in rids
                   for kind, f in (("from the start", read), ("late", late), ("resumed", resumed))]
        await asyncio.gather(*(t for *_, t in readers))
    wrong = [(kind, rid, t.result()) for kind, rid, t in readers if t.result()[0] != t.result()[1]]
    assert not wrong, f"{len(wrong)} of {len(readers)} readers: {wrong[:3]}"
    assert all(t.result()[1] == "".join(f" t{i}" for i in range(tokens)) for *_, t in readers)
