"""The real engine, a lease shorter than a batch, in every batching mode: nothing is taken away
from a live worker; and a request taken over mid-generation resumes after what it streamed."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import redis as redis_sync
import redis.asyncio as aioredis

from sluice.bench.sse import sse_events
from sluice.broker.delivery.consumer import Delivery, StreamConsumer
from sluice.broker.keys import GROUP, ModelKeys
from sluice.broker.limits import ConsumerLimits
from sluice.protocol.messages import RequestMessage
from tests.e2e.conftest import CUSTOM, DYNAMIC, LEASE_TIMEOUT_S, MODEL, Stack, configure, submit, wait_done
from tests.e2e.test_batching_modes import log_records

pytestmark = [pytest.mark.engine, pytest.mark.xdist_group("engine"), pytest.mark.usefixtures("restore_continuous")]

LONG = 160  # tokens: several seconds on this CPU, longer than the lease
COUNTING = "Count from {} onwards, one number per line:"  # greedy decoding keeps going until max_tokens
MODES = {
    "continuous": (MODEL, None),
    "dynamic": (DYNAMIC, {"dynamic_batching_config": {"max_batch_delay_ms": 50, "batch_size_target": 4,
                                                       "batch_size_limit": 8}}),
    "single": (DYNAMIC, {"batch_config": "single"}),
}


async def streamed_text(client: httpx.AsyncClient, rid: str) -> tuple[str, dict]:
    parts, final = [], None
    async with client.stream("GET", f"/v1/requests/{rid}/events") as response:
        async for ev in sse_events(response):
            if ev.event == "delta":
                parts.append(ev.json()["text"])
            elif ev.event in ("done", "error"):
                final = ev.json()
                break
    assert final is not None
    return "".join(parts), final


@pytest.mark.parametrize("mode", list(MODES))
async def test_a_batch_longer_than_the_lease_is_never_taken_away(client: httpx.AsyncClient, mode: str) -> None:
    model, config = MODES[mode]
    if config:
        await configure(client, model, config)
    first = await submit(client, model, prompt=COUNTING.format(1), max_tokens=LONG, temperature=0)
    reader = asyncio.create_task(streamed_text(client, first))
    await asyncio.sleep(0.3)
    second = await submit(client, model, prompt=COUNTING.format(1000), max_tokens=LONG, temperature=0)
    results = [await wait_done(client, rid, timeout_s=300) for rid in (first, second)]
    for result in results:
        assert (result["status"], result["attempt"]) == ("done", 1), result
    # the premise: the first request's generation outlasted the lease
    timings = results[0]["timings"]
    assert timings["finished"] - timings["started"] > LEASE_TIMEOUT_S, timings
    text, final = await reader
    assert text == final["output"]["text"] == results[0]["output"]["text"]
    if mode != "continuous":  # dynamic and single: the second waited for its own batch
        records = await log_records(client, model, [first, second])
        assert len({r["batch_id"] for r in records}) == 2


@pytest.mark.parametrize("model", [MODEL, CUSTOM])
async def test_a_request_taken_over_mid_generation_resumes_after_its_streamed_tokens(
        client: httpx.AsyncClient, stack: Stack, model: str) -> None:
    """Take the entry away from its worker mid-generation (as if it had frozen past its lease):
    the worker aborts it, reclaims it after the lease timeout, and continues from the tokens
    already on the reply stream, with the real engine. What was streamed and the final text
    agree by construction; in float32 greedy they also equal an uninterrupted run."""
    if model == CUSTOM:
        await configure(client, CUSTOM, {"dynamic_batching_config": {"max_batch_delay_ms": 100,
                                                                      "batch_size_target": 2}})
    body = {"prompt": COUNTING.format(7), "max_tokens": 60, "temperature": 0}
    reference = await wait_done(client, await submit(client, model, **body), timeout_s=300)
    rid = await submit(client, model, **body)
    reader = asyncio.create_task(streamed_text(client, rid))
    keys = ModelKeys(model)
    r = redis_sync.Redis.from_url(stack.redis_url, decode_responses=True)
    deadline = time.monotonic() + 120
    while r.xlen(keys.reply(rid)) < 3:
        assert time.monotonic() < deadline, "no tokens streamed"
        await asyncio.sleep(0.05)
    entry = r.hget(keys.status(rid), "entry")
    # A takeover by "ghost", which then stalls: its claim raises the delivery count to 2 and it
    # starts attempt 2 (start.lua), so the running worker is fenced out at once; the entry is not
    # yet reclaimable (ghost's claim is fresh).
    ((_, fields),) = r.xclaim(keys.requests, GROUP, "ghost", 0, [entry])
    async with aioredis.Redis.from_url(stack.redis_url, decode_responses=True) as ar:
        ghost = StreamConsumer(ar, model, "ghost", ConsumerLimits(status_ttl_s=3600, reply_ttl_s=600, log_max_len=100))
        taken = Delivery(keys.requests, entry, RequestMessage.from_fields(fields), "ghost", 2)
        assert await ghost.start(taken) == "run"
    result = await wait_done(client, rid, timeout_s=300)
    text, final = await reader
    assert result["status"] == "done" and result["attempt"] == 3, result
    assert result["output"]["num_output_tokens"] == reference["output"]["num_output_tokens"]
    assert text == result["output"]["text"]
    assert result["output"]["text"] == reference["output"]["text"]
