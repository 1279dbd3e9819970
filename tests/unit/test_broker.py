"""The broker against a private Redis: admission, consumption, guards, leases, commits, replies."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest
from redis.asyncio import Redis

from sluice.broker.admission import Admission, QueueFull
from sluice.broker.consumer import Delivery, StreamConsumer
from sluice.broker.keys import GROUP, MODELS, ModelKeys
from sluice.broker.messages import (
    DeltaEvent,
    FinalResult,
    RequestMessage,
    RowOutput,
    SamplingSpec,
    State,
    Usage,
)
from sluice.broker.registry import ModelRegistry
from sluice.broker.replies import ReplyWriter, read_replies, resume_index
from sluice.config.batching import ContinuousBatchingConfig, DynamicBatchingConfig
from sluice.config.model import ModelConfig
from sluice.config.settings import Settings

MODEL = "t"
KEYS = ModelKeys(MODEL)


def message(*, deadline_in: float = 60.0, lane: str = "interactive", rows: int = 1) -> RequestMessage:
    now = time.time()
    return RequestMessage(
        id=f"req-{uuid.uuid4().hex}",
        model=MODEL,
        rows=[{"prompt": f"hello {i}", "max_tokens": 4} for i in range(rows)],
        sampling=SamplingSpec(max_tokens=4, seed=7),
        enqueued_at=now,
        deadline=now + deadline_in,
        lane=lane,
    )


def admission(redis: Redis, settings: Settings) -> Admission:
    return Admission(redis, status_ttl_s=settings.status_ttl_s, reply_ttl_s=settings.reply_ttl_s,
                     cancel_ttl_s=settings.cancel_ttl_s)


def consumer(redis: Redis, settings: Settings, name: str = "w1") -> StreamConsumer:
    return StreamConsumer(redis, MODEL, name, status_ttl_s=settings.status_ttl_s,
                          reply_ttl_s=settings.reply_ttl_s, log_max_len=settings.log_max_len)


async def ready_consumer(redis: Redis, settings: Settings, name: str = "w1") -> StreamConsumer:
    c = consumer(redis, settings, name)
    await c.ensure_groups()
    return c


async def submit_n(adm: Admission, n: int, **kw) -> list[RequestMessage]:
    out = []
    for _ in range(n):
        m = message(**kw)
        await adm.submit(m, max_queued=1000)
        out.append(m)
    return out


async def pending(redis: Redis, stream: str = KEYS.requests) -> list[dict]:
    return await redis.xpending_range(stream, GROUP, "-", "+", 100)


async def replies(redis: Redis, rid: str) -> list[tuple[str, dict]]:
    return await redis.xrange(KEYS.reply(rid))


def done_result(text: str = " tok tok") -> FinalResult:
    return FinalResult(status=State.DONE, output=RowOutput(text=text, num_output_tokens=2,
                                                           finish_reason="length"),
                       usage=Usage(prompt_tokens=2, completion_tokens=2))


async def fetch_one(c: StreamConsumer) -> Delivery:
    (d,) = await c.fetch(1, 1000)
    return d


async def assert_request_keys_expire(redis: Redis) -> None:
    """Every key but the model's request streams (and the group they carry) has a TTL."""
    without_ttl = []
    async for key in redis.scan_iter("*"):
        if key in (KEYS.requests, KEYS.bulk):
            continue
        if await redis.ttl(key) <= 0:
            without_ttl.append(key)
    assert without_ttl == []


# -- admission --------------------------------------------------------------------------------


async def test_submit_enqueues_and_creates_a_queued_status(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    m = message()
    entry = await adm.submit(m, max_queued=10)
    assert await redis.xlen(KEYS.requests) == 1
    assert await redis.xlen(KEYS.bulk) == 0
    (got_id, fields), = await redis.xrange(KEYS.requests)
    assert got_id == entry
    assert RequestMessage.from_fields(fields) == m
    status = await adm.status(MODEL, m.id)
    assert status["state"] == "queued"
    assert status["entry"] == entry
    assert 0 < await redis.ttl(KEYS.status(m.id)) <= settings.status_ttl_s
    assert await adm.find_model(m.id, ["other", MODEL]) == MODEL
    assert await adm.find_model("req-unknown", ["other", MODEL]) is None


async def test_bulk_requests_go_to_the_bulk_stream(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    await adm.submit(message(lane="bulk"), max_queued=10)
    assert await redis.xlen(KEYS.bulk) == 1
    assert await redis.xlen(KEYS.requests) == 0


async def test_submit_refuses_at_the_bound(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    for _ in range(3):
        await adm.submit(message(), max_queued=3)
    refused = message()
    with pytest.raises(QueueFull):
        await adm.submit(refused, max_queued=3)
    assert await redis.xlen(KEYS.requests) == 3
    assert await adm.status(MODEL, refused.id) == {}


async def test_pending_entries_count_toward_the_bound_until_committed(
        redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    await adm.submit(message(), max_queued=1)
    c = await ready_consumer(redis, settings)
    d = await fetch_one(c)
    with pytest.raises(QueueFull):  # fetched but not finished: still counts
        await adm.submit(message(), max_queued=1)
    assert await c.start(d) == "run"
    assert await c.commit(d, done_result())
    await adm.submit(message(), max_queued=1)


# -- consumer groups and names ----------------------------------------------------------------


async def test_ensure_groups_is_idempotent_and_starts_at_the_beginning(
        redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    (m,) = await submit_n(adm, 1)  # enqueued before any worker created the group
    c = consumer(redis, settings)
    await c.ensure_groups()
    await c.ensure_groups()
    for stream in (KEYS.requests, KEYS.bulk):
        groups = await redis.xinfo_groups(stream)
        assert [g["name"] for g in groups] == [GROUP]
    assert [d.message.id for d in await c.fetch(5, 100)] == [m.id]


async def test_claim_name_takes_the_next_free_suffix(redis: Redis, settings: Settings) -> None:
    a, b, c = (consumer(redis, settings, "gpu0") for _ in range(3))
    assert await a.claim_name(10) == "gpu0"
    assert await b.claim_name(10) == "gpu0-1"
    assert await c.claim_name(10) == "gpu0-2"
    assert (a.consumer, b.consumer, c.consumer) == ("gpu0", "gpu0-1", "gpu0-2")
    assert await redis.pttl(KEYS.consumer_lock("gpu0")) > 0
    await a.release_name()
    again = consumer(redis, settings, "gpu0")
    assert await again.claim_name(10) == "gpu0"


async def test_release_name_leaves_another_holders_lock(redis: Redis, settings: Settings) -> None:
    a = consumer(redis, settings, "gpu0")
    assert await a.claim_name(10) == "gpu0"
    impostor = consumer(redis, settings, "gpu0")  # same name, never claimed it
    await impostor.release_name()
    assert await redis.exists(KEYS.consumer_lock("gpu0")) == 1


# -- fetch ------------------------------------------------------------------------------------


async def test_fetch_returns_at_most_count_in_order(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    sent = [m.id for m in await submit_n(adm, 5)]
    c = await ready_consumer(redis, settings)
    batches = [await c.fetch(2, 100) for _ in range(4)]
    assert [len(b) for b in batches] == [2, 2, 1, 0]
    got = [d.message.id for b in batches for d in b]
    assert got == sent
    assert all(d.attempt == 1 for b in batches for d in b)
    assert await c.fetch(0, 100) == []


async def test_fetch_takes_interactive_before_bulk(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    bulk = [m.id for m in await submit_n(adm, 2, lane="bulk")]
    interactive = [m.id for m in await submit_n(adm, 2)]
    c = await ready_consumer(redis, settings)
    first = await c.fetch(4, 100)
    assert [d.message.id for d in first] == interactive
    assert all(d.stream == KEYS.requests for d in first)
    second = await c.fetch(4, 100)
    assert [d.message.id for d in second] == bulk
    assert all(d.stream == KEYS.bulk for d in second)


async def test_a_restarted_consumer_rereads_its_pending_entries_once(
        redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    sent = [m.id for m in await submit_n(adm, 3)]
    before = await ready_consumer(redis, settings, "w1")
    assert [d.message.id for d in await before.fetch(3, 100)] == sent
    later = await submit_n(adm, 1)

    after = await ready_consumer(redis, settings, "w1")  # the same worker, restarted
    again = await after.fetch(2, 100)
    again += await after.fetch(2, 100)
    assert [d.message.id for d in again] == sent
    assert all(d.attempt == 2 for d in again)
    # then new entries, and never the old ones a second time
    rest = await after.fetch(10, 100)
    assert [d.message.id for d in rest] == [later[0].id]
    assert rest[0].attempt == 1
    assert await after.fetch(10, 100) == []


async def test_another_consumer_does_not_see_foreign_pending_entries(
        redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    await submit_n(adm, 2)
    w1 = await ready_consumer(redis, settings, "w1")
    assert len(await w1.fetch(2, 100)) == 2
    w2 = await ready_consumer(redis, settings, "w2")
    assert await w2.fetch(5, 100) == []


# -- start (the guard) ------------------------------------------------------------------------


async def test_start_marks_the_request_running(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    (m,) = await submit_n(adm, 1)
    c = await ready_consumer(redis, settings)
    d = await fetch_one(c)
    assert await c.start(d) == "run"
    status = await adm.status(MODEL, m.id)
    assert status["state"] == "running"
    assert status["worker"] == "w1"
    assert status["attempt"] == "1"
    assert await redis.ttl(KEYS.status(m.id)) > 0
    assert await redis.xlen(KEYS.requests) == 1  # still there until committed
    assert [p["consumer"] for p in await pending(redis)] == ["w1"]


async def _assert_finished_by_guard(redis: Redis, rid: str, state: str) -> None:
    events = await replies(redis, rid)
    assert len(events) == 1
    assert events[0][1]["kind"] == "final"
    final = FinalResult.model_validate_json(events[0][1]["data"])
    assert final.status.value == state
    assert final.error
    status = await redis.hgetall(KEYS.status(rid))
    assert status["state"] == state
    assert FinalResult.model_validate_json(status["result"]) == final
    assert await redis.xlen(KEYS.requests) == 0
    assert await pending(redis) == []
    await assert_request_keys_expire(redis)


async def test_start_skips_a_cancelled_request(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    (m,) = await submit_n(adm, 1)
    c = await ready_consumer(redis, settings)
    d = await fetch_one(c)
    await redis.set(KEYS.cancel(m.id), "1", ex=60)
    assert await c.start(d) == "cancelled"
    await _assert_finished_by_guard(redis, m.id, "cancelled")


async def test_start_skips_an_expired_request(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    m = message(deadline_in=-1.0)
    await adm.submit(m, max_queued=10)
    c = await ready_consumer(redis, settings)
    d = await fetch_one(c)
    assert await c.start(d) == "expired"
    await _assert_finished_by_guard(redis, m.id, "expired")


async def test_start_is_fenced_for_an_entry_owned_by_another_consumer(
        redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    (m,) = await submit_n(adm, 1)
    c = await ready_consumer(redis, settings)
    d = await fetch_one(c)
    await redis.xclaim(KEYS.requests, GROUP, "w2", 0, [d.entry_id], justid=True)
    assert await c.start(d) == "fenced"
    assert (await adm.status(MODEL, m.id))["state"] == "queued"
    assert await replies(redis, m.id) == []
    assert [p["consumer"] for p in await pending(redis)] == ["w2"]


async def test_start_skips_an_already_final_request(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    (m,) = await submit_n(adm, 1)
    w1 = await ready_consumer(redis, settings, "w1")
    d = await fetch_one(w1)
    assert await w1.start(d) == "run"
    assert await w1.commit(d, done_result())
    # a stale copy of the same request (e.g. redelivered before the commit) is not run again
    await redis.xadd(KEYS.requests, m.to_fields())
    w2 = await ready_consumer(redis, settings, "w2")
    d2 = await fetch_one(w2)
    assert await w2.start(d2) == "final"
    assert await redis.xlen(KEYS.requests) == 0
    assert await pending(redis) == []
    assert len(await replies(redis, m.id)) == 1


# -- commit -----------------------------------------------------------------------------------


async def test_commit_writes_the_final_and_removes_the_entry(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    (m,) = await submit_n(adm, 1)
    c = await ready_consumer(redis, settings)
    d = await fetch_one(c)
    assert await c.start(d) == "run"
    result = done_result()
    assert await c.commit(d, result) is True

    events = await replies(redis, m.id)
    assert [f["kind"] for _, f in events] == ["final"]
    assert FinalResult.model_validate_json(events[0][1]["data"]) == result
    status = await adm.status(MODEL, m.id)
    assert status["state"] == "done"
    assert FinalResult.model_validate_json(status["result"]) == result
    assert 0 < await redis.ttl(KEYS.reply(m.id)) <= settings.reply_ttl_s
    assert 0 < await redis.ttl(KEYS.status(m.id)) <= settings.status_ttl_s
    assert await redis.xlen(KEYS.requests) == 0
    assert await pending(redis) == []
    await assert_request_keys_expire(redis)


async def test_the_inference_log_keeps_records_in_order(redis: Redis, settings: Settings) -> None:
    c = await ready_consumer(redis, settings)
    records = [{"rid": "req-a", "row": 0}, {"rid": "req-b", "row": 0}, {"rid": "req-a", "row": 1}]
    await c.append_log(records[:2])
    await c.append_log(records[2:])
    await c.append_log([])
    logged = [json.loads(f["data"]) for _, f in await redis.xrange(KEYS.log)]
    assert logged == records


async def test_commit_by_a_fenced_out_consumer_writes_nothing(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    (m,) = await submit_n(adm, 1)
    c = await ready_consumer(redis, settings)
    d = await fetch_one(c)
    assert await c.start(d) == "run"
    await redis.xclaim(KEYS.requests, GROUP, "w2", 0, [d.entry_id], justid=True)
    assert await c.commit(d, done_result()) is False
    assert await replies(redis, m.id) == []
    assert await redis.exists(KEYS.reply(m.id)) == 0
    assert (await adm.status(MODEL, m.id))["state"] == "running"
    assert await redis.xlen(KEYS.requests) == 1
    assert [p["consumer"] for p in await pending(redis)] == ["w2"]


async def test_a_second_commit_of_the_same_entry_writes_nothing(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    (m,) = await submit_n(adm, 1)
    c = await ready_consumer(redis, settings)
    d = await fetch_one(c)
    assert await c.start(d) == "run"
    assert await c.commit(d, done_result())
    assert await c.commit(d, done_result("other")) is False
    assert len(await replies(redis, m.id)) == 1


# -- lease ------------------------------------------------------------------------------------


async def test_lease_refreshes_own_entries_and_reports_lost_ones(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    await submit_n(adm, 3)
    c = await ready_consumer(redis, settings, "w1")
    ds = await c.fetch(3, 100)
    for d in ds:
        assert await c.start(d) == "run"
    ids = [d.entry_id for d in ds]
    # age every entry by 100 s (keeping its owner), then hand the middle one to w2
    await redis.xclaim(KEYS.requests, GROUP, "w1", 0, ids, idle=100_000, justid=True)
    await redis.xclaim(KEYS.requests, GROUP, "w2", 0, [ids[1]], idle=100_000, justid=True)

    assert await c.lease(ds) == [ids[1]]

    by_id = {p["message_id"]: p for p in await pending(redis)}
    assert by_id[ids[1]]["consumer"] == "w2"  # not stolen back
    assert by_id[ids[1]]["time_since_delivered"] >= 100_000  # and left alone
    for eid in (ids[0], ids[2]):
        assert by_id[eid]["consumer"] == "w1"
        assert by_id[eid]["time_since_delivered"] < 50_000  # refreshed


async def test_lease_reports_an_entry_no_longer_pending(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    await submit_n(adm, 1)
    c = await ready_consumer(redis, settings)
    d = await fetch_one(c)
    await redis.xack(KEYS.requests, GROUP, d.entry_id)
    assert await c.lease([d]) == [d.entry_id]
    assert await pending(redis) == []


async def test_lease_covers_both_lanes(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    await submit_n(adm, 1)
    await submit_n(adm, 1, lane="bulk")
    c = await ready_consumer(redis, settings)
    ds = await c.fetch(1, 100) + await c.fetch(1, 100)
    assert {d.stream for d in ds} == {KEYS.requests, KEYS.bulk}
    assert await c.lease(ds) == []


# -- cancel -----------------------------------------------------------------------------------


async def test_cancel_of_a_queued_request_ends_it_at_once(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    (m,) = await submit_n(adm, 1)
    assert await adm.cancel(MODEL, m.id) == "cancelled"
    status = await adm.status(MODEL, m.id)
    assert status["state"] == "cancelled"
    events = await replies(redis, m.id)
    assert [f["kind"] for _, f in events] == ["final"]
    assert FinalResult.model_validate_json(events[0][1]["data"]).status is State.CANCELLED
    await assert_request_keys_expire(redis)

    # the worker that later fetches it drops it without running it or writing again
    c = await ready_consumer(redis, settings)
    d = await fetch_one(c)
    assert await c.start(d) == "final"
    assert await redis.xlen(KEYS.requests) == 0
    assert await pending(redis) == []
    assert len(await replies(redis, m.id)) == 1
    # a second cancel reports the final state and changes nothing
    assert await adm.cancel(MODEL, m.id) == "cancelled"
    assert len(await replies(redis, m.id)) == 1


async def test_cancel_of_a_running_request_sets_the_flag(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    (m,) = await submit_n(adm, 1)
    c = await ready_consumer(redis, settings)
    d = await fetch_one(c)
    assert await c.start(d) == "run"
    assert await adm.cancel(MODEL, m.id) == "cancelling"
    assert (await adm.status(MODEL, m.id))["state"] == "running"
    assert 0 < await redis.ttl(KEYS.cancel(m.id)) <= settings.cancel_ttl_s
    assert await c.cancelled([m.id, "req-other"]) == {m.id}
    assert await replies(redis, m.id) == []


async def test_cancel_of_a_finished_or_unknown_request(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    (m,) = await submit_n(adm, 1)
    c = await ready_consumer(redis, settings)
    d = await fetch_one(c)
    assert await c.start(d) == "run"
    assert await c.commit(d, done_result())
    assert await adm.cancel(MODEL, m.id) == "done"
    assert await redis.exists(KEYS.cancel(m.id)) == 0
    assert await adm.cancel(MODEL, "req-unknown") is None


# -- model registry ---------------------------------------------------------------------------


async def test_deploy_versions_changed_deployments_only(redis: Redis) -> None:
    registry = ModelRegistry(redis)
    base = ModelConfig(name="m")
    assert (await registry.deploy(base)).version == 1
    assert (await registry.deploy(base)).version == 1
    assert (await registry.deploy(base.model_copy(update={"version": 9}))).version == 1

    changed = ModelConfig(name="m", continuous_batching_config=ContinuousBatchingConfig(
        max_concurrent_batch_size=8))
    v2 = await registry.deploy(changed)
    assert v2.version == 2
    assert v2.continuous.max_concurrent_batch_size == 8
    assert (await registry.deploy(changed)).version == 2

    kept = await registry.deploy(
        ModelConfig(name="m", dynamic_batching_config=DynamicBatchingConfig()), keep_existing=True)
    assert kept == v2
    assert await registry.get("m") == v2

    # another model is versioned on its own; keep_existing stores a model not yet there
    other = await registry.deploy(ModelConfig(name="n", batch_config="single"), keep_existing=True)
    assert other.version == 1
    assert [m.name for m in await registry.all()] == ["m", "n"]
    assert await registry.get("absent") is None
    assert await redis.hlen(MODELS) == 2


async def test_back_to_an_earlier_deployment_is_a_new_version(redis: Redis) -> None:
    registry = ModelRegistry(redis)
    a = ModelConfig(name="m")
    b = ModelConfig(name="m", batch_config="single")
    assert [(await registry.deploy(x)).version for x in (a, b, a)] == [1, 2, 3]


# -- replies ----------------------------------------------------------------------------------


async def _collect(redis: Redis, rid: str, **kw) -> list:
    return [ev async for ev in read_replies(redis, MODEL, rid, block_ms=100, idle_timeout_s=10, **kw)]


async def test_deltas_then_final_arrive_in_order(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    (m,) = await submit_n(adm, 1)
    c = await ready_consumer(redis, settings)
    d = await fetch_one(c)
    assert await c.start(d) == "run"
    reader = asyncio.create_task(_collect(redis, m.id))  # follows the stream as it grows
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.reply_ttl_s)
    writer.start()
    try:
        for i in range(5):
            writer.delta(m.id, DeltaEvent(i=i, text=f" t{i}", token_ids=[100 + i]))
            await asyncio.sleep(0.01)
        await writer.flush()
        assert 0 < await redis.ttl(KEYS.reply(m.id)) <= settings.reply_ttl_s
        result = done_result("".join(f" t{i}" for i in range(5)))
        assert await c.commit(d, result)
    finally:
        await writer.close()
    events = await asyncio.wait_for(reader, 15)
    assert [e.kind for e in events] == ["delta"] * 5 + ["final"]
    assert [e.delta.i for e in events[:-1]] == [0, 1, 2, 3, 4]
    assert "".join(e.delta.text for e in events[:-1]) == result.output.text
    assert events[-1].final == result


async def test_read_replies_skips_token_indices_already_delivered(redis: Redis, settings: Settings) -> None:
    rid = "req-retried"
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.reply_ttl_s)
    chunks = [(0, [1, 2]), (2, [3]), (3, [4, 5])]
    # attempt 1 wrote everything but died before its commit; attempt 2 (same seed) repeats it
    for attempt in (1, 2):
        for i, ids in chunks:
            writer.delta(rid, DeltaEvent(i=i, text=f"<{i}>", token_ids=ids, attempt=attempt))
            await writer.flush()  # one entry per delta (a buffer's contiguous deltas are joined)
    # and goes one token further before the final
    writer.delta(rid, DeltaEvent(i=5, text="<5>", token_ids=[6], attempt=2))
    await writer.flush()
    await redis.xadd(KEYS.reply(rid), {"kind": "final", "data": done_result().model_dump_json()})
    assert await redis.xlen(KEYS.reply(rid)) == 8

    events = await _collect(redis, rid)
    deltas = [e.delta for e in events if e.kind == "delta"]
    assert [(d.i, d.attempt) for d in deltas] == [(0, 1), (2, 1), (3, 1), (5, 2)]
    assert [t for d in deltas for t in d.token_ids] == [1, 2, 3, 4, 5, 6]
    assert events[-1].kind == "final"


async def test_read_replies_keeps_rows_apart(redis: Redis, settings: Settings) -> None:
    rid = "req-rows"
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.reply_ttl_s)
    for _attempt in range(2):
        for i in range(3):
            for row in (0, 1):
                writer.delta(rid, DeltaEvent(i=i, text="x", token_ids=[i], row=row))
                await writer.flush()
    await redis.xadd(KEYS.reply(rid), {"kind": "final", "data": done_result().model_dump_json()})
    events = await _collect(redis, rid)
    got = sorted((e.delta.row, e.delta.i) for e in events if e.kind == "delta")
    assert got == [(row, i) for row in (0, 1) for i in range(3)]


async def test_reading_resumes_after_a_given_event(redis: Redis, settings: Settings) -> None:
    rid = "req-resume"
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.reply_ttl_s)
    for i in range(4):
        writer.delta(rid, DeltaEvent(i=i, text=f"<{i}>", token_ids=[i]))
        await writer.flush()
    await redis.xadd(KEYS.reply(rid), {"kind": "final", "data": done_result().model_dump_json()})
    first = await _collect(redis, rid)
    last_seen = first[1].entry_id  # the client saw tokens 0 and 1, then lost the connection
    assert await resume_index(redis, MODEL, rid, last_seen) == 2
    rest = await _collect(redis, rid, after=last_seen, next_index=2)
    assert [e.delta.i for e in rest if e.kind == "delta"] == [2, 3]
    assert rest[-1].kind == "final"


async def test_buffered_contiguous_deltas_are_joined(redis: Redis, settings: Settings) -> None:
    rid = "req-joined"
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.reply_ttl_s)
    for i in range(3):
        writer.delta(rid, DeltaEvent(i=i, text=f"<{i}>", token_ids=[i]))
    writer.delta(rid, DeltaEvent(i=0, text="r1", token_ids=[7], row=1))
    writer.delta(rid, DeltaEvent(i=5, text="<5>", token_ids=[5]))  # not contiguous: kept apart
    await writer.flush()
    entries = [DeltaEvent.model_validate_json(f["data"]) for _, f in await redis.xrange(KEYS.reply(rid))]
    assert [(e.row, e.i, e.text, e.token_ids) for e in entries] == [
        (0, 0, "<0><1><2>", [0, 1, 2]), (1, 0, "r1", [7]), (0, 5, "<5>", [5])]


async def test_read_replies_gives_up_after_the_idle_timeout(redis: Redis) -> None:
    events = [ev async for ev in read_replies(redis, MODEL, "req-silent", block_ms=50, idle_timeout_s=0.2)]
    assert events == []


class _LosesFirstCancel:
    """A client whose first pipeline write loses a cancel, as redis-py 8 can on Python 3.11
    (asyncio.wait_for around the socket write returns its result when the cancel and the
    end of the write meet, CPython gh-86296)."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self.entered = asyncio.Event()
        self.swallowed: list[bool] = []

    def pipeline(self, **kw):
        return _Pipeline(self, self.redis.pipeline(**kw))


class _Pipeline:
    def __init__(self, owner: _LosesFirstCancel, real) -> None:
        self.owner, self.real = owner, real

    async def __aenter__(self) -> _Pipeline:
        await self.real.__aenter__()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.real.__aexit__(*exc)

    def __getattr__(self, name: str):
        return getattr(self.real, name)

    async def execute(self):
        if not self.owner.swallowed:
            self.owner.entered.set()
            try:
                await asyncio.sleep(3600)  # the write in flight when the writer is closed
            except asyncio.CancelledError:
                self.owner.swallowed.append(True)
        return await self.real.execute()


async def test_closing_the_reply_writer_survives_a_lost_cancel(redis: Redis, settings: Settings) -> None:
    client = _LosesFirstCancel(redis)
    writer = ReplyWriter(client, MODEL, reply_ttl_s=settings.reply_ttl_s)  # type: ignore[arg-type]
    writer.start()
    writer.delta("req-w", DeltaEvent(i=0, text="a", token_ids=[1]))
    await asyncio.wait_for(client.entered.wait(), 5)
    try:
        await asyncio.wait_for(writer.close(), 3)
    except TimeoutError:
        pytest.fail("ReplyWriter.close() did not return within 3 s: its task lost its cancel")
    assert client.swallowed == [True]
    assert await redis.xlen(KEYS.reply("req-w")) == 1
