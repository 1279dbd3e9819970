"""Retention by design: a finished request leaves a small status hash for its retention and
its reply stream only for a short window; queue bounds cover both lanes and whole calls."""

from __future__ import annotations

import time

import pytest
from redis.asyncio import Redis

from sluice.broker.delivery.dead_letters import DeadLetters
from sluice.broker.intake.admission import Admission, QueueFull
from sluice.broker.limits import AdmissionLimits
from sluice.broker.replies.writer import ReplyWriter
from sluice.config.settings import Settings
from sluice.protocol.messages import DeltaEvent, FinalResult, RequestMessage, RowOutput, SamplingSpec, Usage
from sluice.protocol.states import State
from tests.broker.helpers import (
    KEYS,
    MODEL,
    assert_request_keys_expire,
    cancels,
    fetch_one,
    message,
    queued_len,
    ready_consumer,
)

PROMPT = " ".join(f"word{i}" for i in range(40))
TOKENS = 64


def admission(redis: Redis, settings: Settings, **kw) -> Admission:
    return Admission(redis, AdmissionLimits.of(settings, **kw))


def prompt_message() -> RequestMessage:
    m = message()
    return m.model_copy(update={"rows": [{"prompt": PROMPT, "max_tokens": TOKENS}],
                                "sampling": SamplingSpec(max_tokens=TOKENS, seed=7)})


async def finish_streamed(redis: Redis, settings: Settings, m: RequestMessage, **submit) -> str:
    """Admit `m`, run it through a consumer with one delta per token, commit; the output text."""
    await admission(redis, settings).submit(m, max_queued=100, **submit)
    c = await ready_consumer(redis, settings)
    d = await fetch_one(c)
    assert await c.start(d) == "run"
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.status_ttl_s)
    text = ""
    for i in range(TOKENS):
        writer.delta(d, DeltaEvent(i=i, text=f" t{i}", token_ids=[1000 + i]))
        text += f" t{i}"
        await writer.flush()  # one entry per token, as an unhurried engine writes them
    output = RowOutput(text=text, num_output_tokens=TOKENS, finish_reason="length")
    final = FinalResult(status=State.DONE, output=output,
                        usage=Usage(prompt_tokens=40, completion_tokens=TOKENS))
    assert await c.commit(d, final)
    return text


async def test_a_finished_request_keeps_a_small_result_and_drops_its_replies_soon(
        redis: Redis, settings: Settings) -> None:
    m = prompt_message()
    text = await finish_streamed(redis, settings, m)
    status_key, reply_key = KEYS.status(m.id), KEYS.reply(m.id)
    assert 0 < await redis.ttl(reply_key) <= settings.reply_ttl_s == 60
    assert settings.reply_ttl_s < await redis.ttl(status_key) <= settings.result_ttl_s == 3600
    fields = await redis.hgetall(status_key)
    assert fields["state"] == "done"
    assert not [f for f in fields if f.startswith("next:") or f in ("entry", "stream", "charges")]
    # Every field counted (SAMPLES 0): by default MEMORY USAGE extrapolates from five fields drawn
    # at random, 982 to 2,326 bytes for this hash depending on whether the result was drawn.
    used = await redis.memory_usage(status_key, samples=0)
    assert used < 2048 + len(text), f"{used} bytes for {len(text)} characters of output"
    await assert_request_keys_expire(redis)


async def test_a_model_keeps_results_for_its_own_retention(redis: Redis, settings: Settings) -> None:
    m = prompt_message()
    await finish_streamed(redis, settings, m, result_ttl_s=120)
    assert 60 < await redis.ttl(KEYS.status(m.id)) <= 120


async def test_a_cancelled_request_keeps_its_result_for_the_retention(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    m = message()
    await adm.submit(m, max_queued=10)
    assert await cancels(redis, settings).cancel(MODEL, m.id) == "cancelled"
    assert 0 < await redis.ttl(KEYS.status(m.id)) <= settings.result_ttl_s
    assert 0 < await redis.ttl(KEYS.reply(m.id)) <= settings.reply_ttl_s


async def test_bulk_cannot_take_the_interactive_share(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings, bulk_queue_share=0.5)
    for _ in range(5):
        await adm.submit(message(lane="bulk"), max_queued=10)
    with pytest.raises(QueueFull):
        await adm.submit(message(lane="bulk"), max_queued=10)
    for _ in range(5):
        await adm.submit(message(), max_queued=10)
    with pytest.raises(QueueFull):  # both lanes count against the one bound
        await adm.submit(message(), max_queued=10)
    assert (await queued_len(redis), await queued_len(redis, KEYS.bulk)) == (5, 5)


async def test_several_requests_are_admitted_whole_or_refused_whole(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    await adm.submit(message(), max_queued=4)
    many = [message() for _ in range(4)]
    with pytest.raises(QueueFull):
        await adm.submit_many(many, max_queued=4)
    assert await queued_len(redis) == 1
    assert not any([await redis.exists(KEYS.status(m.id)) for m in many])
    entries = await adm.submit_many(many[:3], max_queued=4)
    assert len(entries) == 3 and await queued_len(redis) == 4
    assert await adm.submit_many(many[:3], max_queued=4) == entries  # a re-run admits nothing twice


async def test_dlq_retry_counts_both_lanes(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    m = message()
    await adm.submit(m, max_queued=10)
    c = await ready_consumer(redis, settings)
    d = await fetch_one(c)
    assert await c.dead_letter(d.stream, d.entry_id, m.id, m.model_dump_json(), "boom", 3)
    for lane in ("bulk", "bulk", "interactive", "interactive"):
        await adm.submit(message(lane=lane), max_queued=10)
    letters = DeadLetters(redis, MODEL, status_ttl_s=settings.status_ttl_s)
    assert await letters.retry(None, max_queued=4) == []
    assert await letters.retry(None, max_queued=5) == [m.id]


async def test_dead_consumers_that_hold_nothing_leave_the_group(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    gone = await ready_consumer(redis, settings, "gone")
    await gone.claim_name(0.2)
    holding = await ready_consumer(redis, settings, "holding")
    await holding.claim_name(0.2)
    await adm.submit(message(), max_queued=10)
    await fetch_one(holding)  # dies holding an entry: it stays until the entry is reclaimed
    await gone.fetch(1, 10)  # read nothing, but now a consumer of the group
    live = await ready_consumer(redis, settings, "live")
    await live.claim_name(30)
    await live.fetch(1, 10)
    time.sleep(0.3)  # the dead workers' name locks expire
    assert await live.prune_consumers() == ["gone"]
    names = {c["name"] for c in await redis.xinfo_consumers(KEYS.requests, "workers")}
    assert names == {"holding", "live"}
