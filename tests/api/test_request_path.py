"""The request path in-process, with a null-engine worker: submit, poll, long-poll (`?wait=`),
server-sent events, cancel, and another key's request answered as missing (404)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Awaitable, Callable

import httpx
import pytest
from fastapi import FastAPI
from redis.asyncio import Redis

from sluice.bench.sse import sse_events
from sluice.protocol.messages import RequestMessage
from sluice.protocol.states import State
from sluice.workers.worker import Worker
from tests.api.conftest import StartApi, http_client
from tests.broker.helpers import KEYS, MODEL

WAIT_S = 30  # a long-poll's bound: far above what a null-engine request takes


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        await asyncio.sleep(0.02)


async def submit(api: httpx.AsyncClient, **body: object) -> str:
    r = await api.post("/v1/requests", json={"prompt": "say something", "max_tokens": 3, **body})
    assert r.status_code == 202, r.text
    assert r.json()["status"] == "queued" and r.json()["model"] == MODEL
    return r.json()["id"]


async def test_a_submitted_request_completes_and_a_long_poll_returns_it_final(
        api: httpx.AsyncClient, null_worker: Worker) -> None:
    rid = await submit(api)
    done = (await api.get(f"/v1/requests/{rid}", params={"wait": WAIT_S})).json()
    assert done["status"] == "done", done
    assert done["output"]["text"] == " t0 t1 t2" and done["output"]["num_output_tokens"] == 3
    assert done["usage"]["completion_tokens"] == 3
    assert (await api.get(f"/v1/requests/{rid}")).json() == done  # a plain poll reads the same final


async def test_a_plain_poll_reads_the_status_once(
        api: httpx.AsyncClient, app: FastAPI, monkeypatch: pytest.MonkeyPatch) -> None:
    """The route's own read (which finds the request's model and owner) is the answer: a poll
    without `wait` reads nothing more; a long-poll reads again while it waits."""
    rid = await submit(api)
    statuses = app.state.sluice.statuses
    reads, read = [], statuses.status

    async def counted(model: str, request_id: str) -> object:
        reads.append(request_id)
        return await read(model, request_id)

    monkeypatch.setattr(statuses, "status", counted)
    polled = await api.get(f"/v1/requests/{rid}")
    assert polled.status_code == 200 and polled.json()["status"] == "queued" and reads == []
    waited = await api.get(f"/v1/requests/{rid}", params={"wait": 0.1})
    assert waited.json()["status"] == "queued" and reads and set(reads) == {rid}


async def test_a_poll_of_an_unserved_request_answers_as_it_is(api: httpx.AsyncClient) -> None:
    rid = await submit(api)
    now = (await api.get(f"/v1/requests/{rid}")).json()
    assert now["status"] == "queued" and "enqueued" in now["timings"]
    # A long-poll that runs out answers the request as it is then, not an error.
    waited = await api.get(f"/v1/requests/{rid}", params={"wait": 0.1})
    assert waited.status_code == 200 and waited.json()["status"] == "queued"


async def test_wait_is_bounded_and_checked(api: httpx.AsyncClient) -> None:
    rid = await submit(api)
    r = await api.get(f"/v1/requests/{rid}", params={"wait": -1})
    assert r.status_code == 422 and r.json()["error"]["param"] == "wait", r.text
    r = await api.get(f"/v1/requests/{rid}", params={"wait": "soon"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "wait", r.text


async def test_events_stream_every_delta_then_done(api: httpx.AsyncClient, null_worker: Worker) -> None:
    rid = await submit(api, max_tokens=4)
    async with api.stream("GET", f"/v1/requests/{rid}/events") as response:
        assert response.status_code == 200
        events = [e async for e in sse_events(response)]
    # One delta per token, except that the writer joins tokens that came while its last write
    # was under way (a loaded machine): every token exactly once, in order, then done.
    assert [e.event for e in events] == ["delta"] * (len(events) - 1) + ["done"] and len(events) >= 2
    indexes = [e.json()["index"] for e in events[:-1]]
    assert indexes[0] == 0 and indexes == sorted(set(indexes))
    final = events[-1].json()
    assert "".join(e.json()["text"] for e in events[:-1]) == final["output"]["text"] == " t0 t1 t2 t3"
    assert len({e.id for e in events}) == len(events)  # each resumable by its own id


async def test_events_resume_after_last_event_id(api: httpx.AsyncClient, null_worker: Worker) -> None:
    rid = await submit(api, max_tokens=3)
    await api.get(f"/v1/requests/{rid}", params={"wait": WAIT_S})
    first = [e async for e in sse_events(await api.get(f"/v1/requests/{rid}/events"))]
    rest = [e async for e in sse_events(await api.get(f"/v1/requests/{rid}/events",
                                                      headers={"Last-Event-ID": first[0].id or ""}))]
    assert [e.id for e in rest] == [e.id for e in first[1:]]


async def test_events_whose_status_read_saw_the_request_unfinished_end_with_its_final(
        api: httpx.AsyncClient, app: FastAPI, null_worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    """The events route reads the status once, and follows a request that was not final then with
    no status read of its follower's own (its stream cannot have expired): one that finished just
    after that read (staged: the read is served the status as it was while queued) still streams
    every token, then its final, from its reply stream."""
    rid = await submit(api, max_tokens=3)
    statuses, router = app.state.sluice.statuses, app.state.sluice.replies
    done = (await api.get(f"/v1/requests/{rid}", params={"wait": WAIT_S})).json()
    final = await statuses.status(MODEL, rid)
    stale, read = [dataclasses.replace(final, state=State.QUEUED, result=None)], statuses.find_status

    async def find_status(request_id: str, models: list[str]) -> object:
        return stale.pop() if stale else await read(request_id, models)

    looked: list[str] = []
    lost_final = router._lost_final

    async def counted(keys: object, request_id: str, follower: object) -> object:
        looked.append(request_id)
        return await lost_final(keys, request_id, follower)

    monkeypatch.setattr(statuses, "find_status", find_status)
    monkeypatch.setattr(router, "_lost_final", counted)
    events = [e async for e in sse_events(await api.get(f"/v1/requests/{rid}/events"))]
    assert not stale and looked == []  # one status read, the staged one; none by the follower
    assert "".join(e.json()["text"] for e in events[:-1]) == " t0 t1 t2"
    assert events[-1].event == "done" and events[-1].json() == done


async def test_cancel_stops_a_running_request(api: httpx.AsyncClient, null_worker: Worker) -> None:
    rid = await submit(api, max_tokens=8000)  # about 80 s if left alone

    async def running() -> bool:
        return (await api.get(f"/v1/requests/{rid}")).json()["status"] == "running"

    await eventually(running, what="the request to start")
    r = await api.delete(f"/v1/requests/{rid}")
    assert r.status_code == 202, r.text  # accepted: its worker aborts it
    assert r.json() == {"id": rid, "model": MODEL, "status": "cancelling"}
    final = (await api.get(f"/v1/requests/{rid}", params={"wait": WAIT_S})).json()
    assert final["status"] == "cancelled", final
    again = await api.delete(f"/v1/requests/{rid}")  # cancelling a final request changes nothing
    assert again.status_code == 409 and again.json()["error"]["code"] == "already_final", again.text
    assert again.json()["request"] == final
    assert (await api.get(f"/v1/requests/{rid}")).json()["status"] == "cancelled"


async def test_a_cancel_that_read_the_request_running_before_its_cancelled_final_is_a_409(
        api: httpx.AsyncClient, app: FastAPI, null_worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second DELETE whose read saw the request running, just before its worker wrote the
    cancelled final (staged: that read is served the status as it was), finds it final: 409 as
    any later one (its script answers 'cancelled' for a cancelled request: not a cancel of its own)."""
    rid = await submit(api, max_tokens=8000)
    statuses = app.state.sluice.statuses

    async def running() -> bool:
        return (await api.get(f"/v1/requests/{rid}")).json()["status"] == "running"

    await eventually(running, what="the request to start")
    was_running = await statuses.status(MODEL, rid)
    assert (await api.delete(f"/v1/requests/{rid}")).status_code == 202
    final = (await api.get(f"/v1/requests/{rid}", params={"wait": WAIT_S})).json()
    assert final["status"] == "cancelled", final
    stale, read = [was_running], statuses.find_status

    async def find_status(request_id: str, models: list[str]) -> object:
        return stale.pop() if stale else await read(request_id, models)

    monkeypatch.setattr(statuses, "find_status", find_status)
    again = await api.delete(f"/v1/requests/{rid}")
    assert not stale, "the staged read was not made"
    assert again.status_code == 409 and again.json()["error"]["code"] == "already_final", again.text
    assert again.json()["request"] == final


async def test_a_cancelled_queued_request_never_runs(api: httpx.AsyncClient) -> None:
    rid = await submit(api)
    r = await api.delete(f"/v1/requests/{rid}")
    assert r.status_code == 200, r.text  # done at once: the answer is its final, as GET shows it
    assert r.json()["status"] == "cancelled" and r.json()["error"] == "cancelled by the client"
    assert r.json() == (await api.get(f"/v1/requests/{rid}")).json()


async def test_cancelling_a_finished_request_is_a_409_naming_its_state(
        api: httpx.AsyncClient, null_worker: Worker) -> None:
    rid = await submit(api)
    done = (await api.get(f"/v1/requests/{rid}", params={"wait": WAIT_S})).json()
    assert done["status"] == "done", done
    r = await api.delete(f"/v1/requests/{rid}")
    assert r.status_code == 409, r.text
    assert r.json()["error"] == {"message": f"request {rid!r} is already done: only a queued or running request "
                                            "can be cancelled", "type": "already_final", "param": "id",
                                 "code": "already_final"}
    assert r.json()["request"] == done  # the final comes with it
    assert (await api.get(f"/v1/requests/{rid}")).json() == done  # nothing changed


async def test_an_unknown_request_is_a_404_on_every_route(api: httpx.AsyncClient) -> None:
    rid = "req-0123456789abcdef0123456789abcdef"
    for method, url in (("GET", f"/v1/requests/{rid}"), ("GET", f"/v1/requests/{rid}/events"),
                        ("DELETE", f"/v1/requests/{rid}")):
        r = await api.request(method, url)
        assert r.status_code == 404, (url, r.text)
        assert r.json()["error"] == {"message": f"request {rid!r} not found", "type": "not_found",
                                     "param": None, "code": "not_found"}


async def test_another_keys_request_is_a_404_exactly_like_an_unknown_one(start_api: StartApi) -> None:
    async with start_api(api_keys=["alice-key", "bob-key"]) as app:
        alice, bob = http_client(app, "alice-key"), http_client(app, "bob-key")
        async with alice, bob:
            rid = await submit(alice)
            unknown = "req-0123456789abcdef0123456789abcdef"
            for method, path in (("GET", ""), ("GET", "/events"), ("DELETE", "")):
                theirs = await bob.request(method, f"/v1/requests/{rid}{path}")
                missing = await bob.request(method, f"/v1/requests/{unknown}{path}")
                assert theirs.status_code == missing.status_code == 404, theirs.text
                assert theirs.json()["error"]["message"] == f"request {rid!r} not found"
                assert theirs.json()["error"]["type"] == missing.json()["error"]["type"]
            assert (await alice.get(f"/v1/requests/{rid}")).json()["status"] == "queued"  # bob changed nothing
            assert (await http_client(app).get(f"/v1/requests/{rid}")).status_code == 401


async def test_bad_submissions_are_4xx_naming_the_field(api: httpx.AsyncClient) -> None:
    for body, param in (({"prompt": "", "max_tokens": 2}, "prompt"), ({"prompt": "p", "max_tokens": 0}, "max_tokens"),
                        ({"prompt": "p", "temperature": 9}, "temperature"), ({"prompt": "p", "nope": 1}, "nope"),
                        ({"prompt": "p", "model": "absent"}, "model")):
        r = await api.post("/v1/requests", json=body)
        assert 400 <= r.status_code < 500, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.text)


async def test_an_openai_completion_runs_through_the_queue(api: httpx.AsyncClient, null_worker: Worker) -> None:
    r = await api.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "n": 2})
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == [" t0 t1", " t0 t1"]


async def test_a_streamed_completion_of_several_choices_merges_them(api: httpx.AsyncClient,
                                                                     null_worker: Worker) -> None:
    body = {"model": MODEL, "prompt": ["a", "b"], "n": 2, "max_tokens": 3, "stream": True}
    async with api.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = [e.data async for e in sse_events(r)]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for c in chunks:
        (choice,) = c["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"]:
            reasons[choice["index"]] = choice["finish_reason"]
    assert texts == {i: " t0 t1 t2" for i in range(4)}  # every choice whole, none twice
    assert reasons == {i: "length" for i in range(4)}


async def test_a_model_missing_from_redis_comes_back_without_a_read_deploying_it(
        app: FastAPI, api: httpx.AsyncClient, redis: Redis) -> None:
    """Redis lost the deployments (restarted without its data): a request gets a 503 to retry,
    never a 404, and the models file's sync task (not the read) registers the model again."""
    await redis.flushdb()
    s = app.state.sluice
    await s.deployments.all(fresh=True)
    r = await api.post("/v1/requests", json={"prompt": "p", "max_tokens": 2})
    assert r.status_code in (202, 503), r.text
    if r.status_code == 503:
        assert r.headers["Retry-After"] and "retry" in r.json()["error"]["message"]

    async def back() -> bool:
        return (await api.post("/v1/requests", json={"prompt": "p", "max_tokens": 2})).status_code == 202

    await eventually(back, what="the model to be registered again")


async def test_sampling_choices_reach_the_entry(api: httpx.AsyncClient, redis: Redis) -> None:
    rid = await submit(api, stop=["\n", "END"], seed=11, temperature=0.5)
    ((_, fields),) = await redis.xrange(KEYS.requests)
    entry = RequestMessage.from_fields(fields)
    assert entry.id == rid and entry.sampling.stop == ["\n", "END"] and entry.sampling.seed == 11
    assert entry.sampling.temperature == 0.5 and entry.rows == [{"prompt": "say something", "max_tokens": 3}]


async def test_vllm_sampling_extras_reach_the_entry_from_the_native_route(api: httpx.AsyncClient,
                                                                          redis: Redis) -> None:
    await submit(api, top_k=4, min_p=0.05, repetition_penalty=1.1, min_tokens=2, ignore_eos=True,
                 stop_token_ids=[3], presence_penalty=0.5)
    ((_, fields),) = await redis.xrange(KEYS.requests)
    s = RequestMessage.from_fields(fields).sampling
    assert (s.top_k, s.min_p, s.repetition_penalty, s.min_tokens, s.ignore_eos, s.stop_token_ids) == \
           (4, 0.05, 1.1, 2, True, [3])
    assert s.presence_penalty == 0.5
    r = await api.post("/v1/requests", json={"prompt": "p", "logit_bias": {"1": 2}})
    assert r.status_code == 422 and r.json()["error"]["param"] == "logit_bias"  # never dropped silently
