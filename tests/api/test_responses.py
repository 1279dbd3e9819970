"""The Responses API in-process with the official SDK and a null-engine worker: background
responses polled to completion, a streamed response's numbered events and its resumption
after any sequence number, cancel and delete, a response that outlives its api process, and
what is refused. (The real engine and a dropped connection: tests/e2e/test_responses.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import openai
import pytest
from fastapi import FastAPI
from redis.asyncio import Redis

from sluice.broker.plumbing.connection import connect
from sluice.config.model import load_models
from sluice.config.settings import Settings
from sluice.protocol.messages import DeltaEvent, FinalResult, RequestMessage
from sluice.protocol.openai_responses import request_id
from sluice.workers.engines.null import NullEngine
from sluice.workers.worker import Worker
from tests.api.conftest import TOKEN_DELAY_S, StartApi, http_client
from tests.broker.helpers import KEYS, MODEL
from tests.fakes import eventually
from tests.workers.test_worker_delivery import died_after_streaming


def sdk_for(app: FastAPI) -> openai.AsyncOpenAI:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", max_retries=0,
                              http_client=httpx.AsyncClient(transport=transport, base_url="http://test"))


@pytest.fixture
def sdk(app: FastAPI) -> openai.AsyncOpenAI:
    return sdk_for(app)


async def finished(sdk: openai.AsyncOpenAI, rid: str) -> openai.types.responses.Response:
    got: list = []

    async def final() -> bool:
        got.append(await sdk.responses.retrieve(rid))
        return got[-1].status not in ("queued", "in_progress")

    await eventually(final, what="the response to finish", interval_s=0.05)
    return got[-1]


async def test_a_background_response_is_queued_then_polled_to_completion(
        sdk: openai.AsyncOpenAI, null_worker: Worker) -> None:
    made = await sdk.responses.create(model=MODEL, input="say hi", instructions="Be brief.", background=True,
                                      max_output_tokens=3, metadata={"job": "42"})
    assert made.id.startswith("resp_") and made.status in ("queued", "in_progress", "incomplete")
    assert made.background and made.metadata == {"job": "42"} and made.instructions == "Be brief."
    done = await finished(sdk, made.id)
    # max_output_tokens ran out: OpenAI calls that incomplete
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
    assert done.output_text == " t0 t1 t2" and done.usage.output_tokens == 3
    assert done.metadata == {"job": "42"} and done.created_at == made.created_at


async def test_vllm_sampling_extras_reach_the_entry(app: FastAPI, redis: Redis) -> None:
    async with http_client(app) as api:
        r = await api.post("/v1/responses", json={"model": MODEL, "input": "hi", "background": True,
                                                  "ignore_eos": True, "min_tokens": 3, "top_k": 5})
    assert r.status_code == 200, r.text
    ((_, fields),) = await redis.xrange(KEYS.requests)
    s = RequestMessage.from_fields(fields).sampling
    assert (s.ignore_eos, s.min_tokens, s.top_k) == (True, 3, 5)


async def test_a_foreground_response_answers_with_the_result(sdk: openai.AsyncOpenAI, null_worker: Worker) -> None:
    got = await sdk.responses.create(model=MODEL, input=[{"role": "user", "content": "hi"}], max_output_tokens=2)
    assert got.output_text == " t0 t1" and got.status == "incomplete" and not got.background


async def _events(api: httpx.AsyncClient, method: str, url: str, **kw) -> list[dict]:
    from sluice.bench.sse import sse_events

    async with api.stream(method, url, **kw) as r:
        assert r.status_code == 200, await r.aread()
        return [e.json() async for e in sse_events(r)]


async def test_a_stream_is_numbered_and_resumes_after_any_event(api: httpx.AsyncClient, null_worker: Worker) -> None:
    events = await _events(api, "POST", "/v1/responses", json={"model": MODEL, "input": "hi", "stream": True,
                                                                "background": True, "max_output_tokens": 4})
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == " t0 t1 t2 t3" == events[-4]["text"]
    rid = events[0]["response"]["id"]
    for after in (0, 3, 5, len(events) - 2):
        again = await _events(api, "GET", f"/v1/responses/{rid}", params={"stream": "true", "starting_after": after})
        assert again == events[after + 1:]


async def test_a_background_response_is_cancelled(sdk: openai.AsyncOpenAI, null_worker: Worker) -> None:
    made = await sdk.responses.create(model=MODEL, input="long", background=True, max_output_tokens=3000)
    cancelled = await sdk.responses.cancel(made.id)
    assert cancelled.status in ("cancelled", "queued", "in_progress")
    assert (await finished(sdk, made.id)).status == "cancelled"
    fg = await sdk.responses.create(model=MODEL, input="short", max_output_tokens=1)
    with pytest.raises(openai.BadRequestError, match="background"):
        await sdk.responses.cancel(fg.id)


async def test_a_deleted_response_is_gone(sdk: openai.AsyncOpenAI, null_worker: Worker) -> None:
    made = await sdk.responses.create(model=MODEL, input="x", max_output_tokens=1)
    await sdk.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        await sdk.responses.retrieve(made.id)


async def test_unknown_ids_and_plain_requests_are_not_responses(sdk: openai.AsyncOpenAI,
                                                                api: httpx.AsyncClient) -> None:
    rid = (await api.post("/v1/requests", json={"prompt": "p", "max_tokens": 1})).json()["id"]
    for missing in ("resp_0123", "nope", "resp_" + rid.removeprefix("req-")):
        with pytest.raises(openai.NotFoundError):
            await sdk.responses.retrieve(missing)


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True, "store": False}, "store"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "wat"}}}}, "text"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata"),
])
async def test_what_cannot_be_served_is_a_400_naming_the_field(api: httpx.AsyncClient, redis: Redis,
                                                               body: dict, param: str) -> None:
    r = await api.post("/v1/responses", json={"model": MODEL, "input": "hi", **body})
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["param"].split(".")[0] == param, r.text
    assert not [k async for k in redis.scan_iter("*:resp:*")]  # nothing kept for it


@asynccontextmanager
async def _worker(settings: Settings, redis_url: str) -> AsyncIterator[None]:
    (model,) = [m for m in load_models(settings.models_file) if m.name == MODEL]
    redis = connect(redis_url, name="sluice-test-responses-worker")
    worker = Worker(settings, model, NullEngine(token_delay_s=TOKEN_DELAY_S), redis, "responses-worker")
    task = asyncio.create_task(worker.run())
    try:
        yield
    finally:
        worker.stopping.set()
        await asyncio.wait_for(task, 30)
        await redis.aclose()


async def test_a_background_response_outlives_its_api_process(start_api: StartApi, redis_url: str) -> None:
    async with start_api() as first:
        made = await sdk_for(first).responses.create(model=MODEL, input="later", background=True,
                                                     max_output_tokens=2, metadata={"k": "v"})
    assert made.status == "queued"  # no worker yet; this api process is gone now
    async with start_api() as second:
        async with _worker(second.state.sluice.settings, redis_url):
            done = await finished(sdk_for(second), made.id)
            assert done.output_text == " t0 t1" and done.metadata == {"k": "v"}
            async with http_client(second) as api:
                assert (await api.get(f"/v1/responses/{made.id}")).json()["status"] == "incomplete"


async def test_a_worker_crash_resumes_a_background_response(app: FastAPI, sdk: openai.AsyncOpenAI, redis: Redis,
                                                            redis_url: str) -> None:
    """A response is a request: its first worker streamed two tokens and died; the next one
    continues after them, and the resumed event stream shows each token once."""
    made = await sdk.responses.create(model=MODEL, input="crash me", background=True, max_output_tokens=4)
    settings = app.state.sluice.settings
    await died_after_streaming(redis, settings, DeltaEvent(i=0, text=" t0 t1", token_ids=[0, 1]))
    async with _worker(settings, redis_url):
        done = await finished(sdk, made.id)
    assert done.output_text == " t0 t1 t2 t3" and done.usage.output_tokens == 4
    final = FinalResult.model_validate_json(await redis.hget(KEYS.status(request_id(made.id)), "result"))
    assert final.attempt == 2  # the second worker's
    async with http_client(app) as api:
        events = await _events(api, "GET", f"/v1/responses/{made.id}", params={"stream": "true"})
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == done.output_text and events[-1]["response"]["status"] == "incomplete"


async def test_a_stream_resumed_after_its_reply_stream_expired_still_ends(
        api: httpx.AsyncClient, null_worker: Worker, redis: Redis) -> None:
    """Issue 28, defect 5: once the reply stream has expired, the events rebuilt from the status
    are fewer than the stream had, and a resume after more of them than that got nothing, not
    even the terminal event. Resumed after any number, a stream ends: numbered after it, with
    the whole text in `response.output_text.done`, the same terminal event as before; the text
    again as one delta only to a client that had seen none of it."""
    events = await _events(api, "POST", "/v1/responses", json={"model": MODEL, "input": "hi", "stream": True,
                                                                "background": True, "max_output_tokens": 6})
    rid = events[0]["response"]["id"]
    text = events[-4]["text"]
    assert text == " t0 t1 t2 t3 t4 t5"
    await redis.delete(KEYS.reply(request_id(rid)))  # what its TTL does after the final
    for after in range(-1, len(events) + 2):
        again = await _events(api, "GET", f"/v1/responses/{rid}", params={"stream": "true", "starting_after": after})
        assert again, f"nothing after {after}"
        assert [e["sequence_number"] for e in again] == list(range(after + 1, after + 1 + len(again)))
        assert again[-1] == {**events[-1], "sequence_number": again[-1]["sequence_number"]}
        kinds = [e["type"] for e in again]
        assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                                "response.output_item.done"] and again[-4]["text"] == text
        deltas = [e["delta"] for e in again if e["type"] == "response.output_text.delta"]
        assert deltas == ([text] if after < 4 else []), (after, kinds)  # events 0-3 come before any text
        if after < 4:
            assert again[:4 - after - 1] == events[after + 1:4]
