"""One request's whole path on real parts: api -> Redis stream -> worker -> vLLM -> reply stream."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from sluice.bench.sse import sse_events
from tests.e2e.conftest import MODEL, Stack, submit, wait_done

pytestmark = [pytest.mark.engine, pytest.mark.xdist_group("engine")]

GREEDY = {"temperature": 0.0}


async def test_submit_and_poll_paris(client: httpx.AsyncClient) -> None:
    rid = await submit(client, prompt="The capital of France is", max_tokens=8, **GREEDY)
    result = await wait_done(client, rid)
    assert result["status"] == "done", result
    assert result["output"]["text"].startswith(" Paris"), result
    assert result["output"]["num_output_tokens"] == 8
    assert result["output"]["finish_reason"] == "length"
    t = result["timings"]
    assert t["enqueued"] <= t["started"] <= t["first_token"] <= t["finished"]


async def test_events_stream_joins_to_polled_text(client: httpx.AsyncClient) -> None:
    rid = await submit(client, prompt="List three colors:", max_tokens=16, **GREEDY)
    deltas, done = [], None
    async with client.stream("GET", f"/v1/requests/{rid}/events") as response:
        assert response.status_code == 200
        async for ev in sse_events(response):
            if ev.event == "delta":
                deltas.append(ev.json())
            elif ev.event in ("done", "error"):
                done = ev
                break
    assert done is not None and done.event == "done", done
    assert len(deltas) >= 2
    assert [d["index"] for d in deltas] == sorted({d["index"] for d in deltas})
    polled = (await client.get(f"/v1/requests/{rid}")).json()
    assert "".join(d["text"] for d in deltas) == polled["output"]["text"]
    assert done.json()["output"]["text"] == polled["output"]["text"]


async def test_events_resume_with_last_event_id(client: httpx.AsyncClient) -> None:
    rid = await submit(client, prompt="Count from one to ten:", max_tokens=12, **GREEDY)
    final = await wait_done(client, rid)
    async with client.stream("GET", f"/v1/requests/{rid}/events") as response:
        events = [ev async for ev in sse_events(response)]
    deltas = [e for e in events if e.event == "delta"]
    assert len(deltas) >= 3
    cut = deltas[1]
    async with client.stream("GET", f"/v1/requests/{rid}/events", headers={"Last-Event-ID": cut.id}) as response:
        resumed = [ev async for ev in sse_events(response)]
    resumed_text = "".join(e.json()["text"] for e in resumed if e.event == "delta")
    assert deltas[0].json()["text"] + cut.json()["text"] + resumed_text == final["output"]["text"]
    assert resumed[-1].event == "done"


PROMPTS = [
    f"{subject} is" for subject in [
        "The capital of France", "The largest planet", "Python", "The ocean", "A cat", "Music",
        "The moon", "Coffee", "A good book", "The internet", "Winter", "A mountain", "Rain",
        "The sun", "Chess", "A library", "Bread", "The river", "A teacher", "Gold", "Time",
        "A bicycle", "The forest", "Light", "Friendship", "A computer", "The desert", "Snow",
        "A garden", "History", "The city", "A star",
    ]
]


async def direct_outputs(model_dir, prompts: list[str], max_tokens: int) -> list[str]:
    """The same prompts on AsyncLLMEngine directly, with the stack's engine options."""
    from vllm import AsyncEngineArgs, AsyncLLMEngine, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=2048,
        max_num_seqs=64, seed=0, disable_log_stats=True, kv_cache_memory_bytes=2**30,
    ))
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, output_kind=RequestOutputKind.FINAL_ONLY)

        async def one(i: int, prompt: str) -> str:
            text = ""
            async for out in engine.generate(prompt, params, request_id=f"direct-{i}"):
                text = out.outputs[0].text
            return text

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    finally:
        engine.shutdown()


async def test_32_concurrent_requests_match_the_engine_directly(client: httpx.AsyncClient, stack: Stack) -> None:
    assert len(set(PROMPTS)) == 32
    expected = await direct_outputs(stack.model_dir, PROMPTS, 32)
    rids = await asyncio.gather(*(submit(client, prompt=p, max_tokens=32, **GREEDY) for p in PROMPTS))
    results = await asyncio.gather(*(wait_done(client, rid) for rid in rids))
    for prompt, want, got in zip(PROMPTS, expected, results):
        assert got["status"] == "done", got
        assert 0 < got["output"]["num_output_tokens"] <= 32
        assert got["output"]["text"] == want, f"{prompt!r}: {got['output']['text']!r} != {want!r}"


async def in_flight(client: httpx.AsyncClient) -> int:
    workers = (await client.get("/v1/workers")).json()["workers"]
    return sum(w["in_flight"] for w in workers if w["model"] == MODEL)


async def test_cancel_during_generation_frees_the_slot(client: httpx.AsyncClient) -> None:
    rid = await submit(client, prompt="Write a very long story about a dragon.", max_tokens=1500,
                       temperature=0.8, seed=7)
    deadline = time.monotonic() + 60
    while (await client.get(f"/v1/requests/{rid}")).json()["status"] != "running":
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    while await in_flight(client) < 1:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    r = await client.delete(f"/v1/requests/{rid}")
    assert r.status_code == 202 and r.json()["status"] == "cancelling", r.text
    result = await wait_done(client, rid, timeout_s=30)
    assert result["status"] == "cancelled", result
    # Cut short: 1500 tokens take about a minute here (no stopwatch: the machine is shared).
    assert result["output"]["num_output_tokens"] < 1500
    deadline = time.monotonic() + 60
    while await in_flight(client) != 0:
        assert time.monotonic() < deadline, "in-flight count did not drop"
        await asyncio.sleep(0.1)


async def test_a_stream_disconnect_cancels_nothing_a_delete_does(client: httpx.AsyncClient) -> None:
    # Sampled with a fixed seed: this prompt runs long instead of stopping at once.
    rid = await submit(client, prompt="Write a very long story about a dragon.", max_tokens=1500,
                       temperature=0.8, seed=7)
    async with client.stream("GET", f"/v1/requests/{rid}/events") as response:
        async for ev in sse_events(response):
            if ev.event == "delta":
                break  # leave after the first token: the reader goes away
    # watching is not owning: the generation goes on (a long poll of a second shows it running)
    still = (await client.get(f"/v1/requests/{rid}", params={"wait": 1})).json()
    assert still["status"] == "running", still
    r = await client.delete(f"/v1/requests/{rid}")
    assert r.status_code == 202
    result = await wait_done(client, rid, timeout_s=30)
    assert result["status"] == "cancelled", result


async def test_unknown_model_request_and_bad_bodies(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/requests", json={"model": "nope", "prompt": "hi"})
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
    r = await client.get("/v1/requests/req-doesnotexist")
    assert r.status_code == 404
    r = await client.post("/v1/requests", json={"prompt": "hi", "max_tokens": -1})
    assert r.status_code == 422 and "max_tokens" in r.json()["error"]["message"]
    r = await client.post("/v1/requests", json={"max_tokens": 3})
    assert r.status_code == 422 and "prompt" in r.json()["error"]["message"]
    r = await client.post("/v1/requests", json={"prompt": "hi", "bogus": 1})
    assert r.status_code == 422 and "bogus" in r.json()["error"]["message"]
    r = await client.post("/v1/requests", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422
    r = await client.post("/v1/requests", json={"prompt": "hi", "max_tokens": 4096})
    assert r.status_code == 422 and "max_tokens" in r.json()["error"]["message"]


async def test_health_and_readiness(client: httpx.AsyncClient) -> None:
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    r = await client.get("/readyz")
    assert r.status_code == 200 and r.json()["models"][MODEL] == 1
