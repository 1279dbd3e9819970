"""Reply channels: the writer, the reader's skipping and resuming, closing under a lost cancel."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from redis.asyncio import Redis

from sluice.broker.keys import GROUP
from sluice.broker.replies.router import resume_index
from sluice.broker.replies.writer import ReplyWriter, _coalesce, delivered
from sluice.config.settings import Settings
from sluice.protocol.messages import DeltaEvent
from tests.broker.helpers import (
    KEYS,
    MODEL,
    done_result,
    failing_flush,
    read_events,
    running_request,
    take_over,
)

# -- replies ----------------------------------------------------------------------------------


async def _collect(redis: Redis, rid: str, **kw) -> list:
    return await read_events(redis, rid, idle_timeout_s=10, **kw)


async def test_deltas_then_final_arrive_in_order(redis: Redis, settings: Settings) -> None:
    adm, m, c, d = await running_request(redis, settings)
    reader = asyncio.create_task(_collect(redis, m.id))  # follows the stream as it grows
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.reply_ttl_s)
    writer.start()
    try:
        for i in range(5):
            writer.delta(d, DeltaEvent(i=i, text=f" t{i}", token_ids=[100 + i]))
            await asyncio.sleep(0.01)
        await writer.flush()
        assert 0 < await redis.ttl(KEYS.reply(m.id)) <= settings.reply_ttl_s
        result = done_result("".join(f" t{i}" for i in range(5)))
        assert await c.commit(d, result)
    finally:
        await writer.close()
    events = await asyncio.wait_for(reader, 15)
    # A flush that lags behind joins waiting deltas into one (ReplyWriter._coalesce): the
    # tokens arrive in order, each once, in up to five entries.
    assert [e.kind for e in events[:-1]] == ["delta"] * (len(events) - 1) and 2 <= len(events) <= 6
    assert [t for e in events[:-1] for t in e.delta.token_ids] == [100, 101, 102, 103, 104]
    assert [e.delta.i for e in events[:-1]] == sorted({e.delta.i for e in events[:-1]})
    assert "".join(e.delta.text for e in events[:-1]) == result.output.text
    assert events[-1].final == result


async def test_the_reader_skips_token_indices_already_delivered(redis: Redis) -> None:
    """A stream written before retries resumed (attempt 2 repeating attempt 1's tokens):
    readers still deliver each index once."""
    rid = "req-retried"
    chunks = [(0, [1, 2]), (2, [3]), (3, [4, 5])]
    for attempt in (1, 2):
        for i, ids in chunks:
            ev = DeltaEvent(i=i, text=f"<{i}>", token_ids=ids, attempt=attempt)
            await redis.xadd(KEYS.reply(rid), {"kind": "delta", "data": ev.model_dump_json()})
    ev = DeltaEvent(i=5, text="<5>", token_ids=[6], attempt=2)  # and one token further
    await redis.xadd(KEYS.reply(rid), {"kind": "delta", "data": ev.model_dump_json()})
    await redis.xadd(KEYS.reply(rid), {"kind": "final", "data": done_result().model_dump_json()})

    events = await _collect(redis, rid)
    deltas = [e.delta for e in events if e.kind == "delta"]
    assert [(d.i, d.attempt) for d in deltas] == [(0, 1), (2, 1), (3, 1), (5, 2)]
    assert [t for d in deltas for t in d.token_ids] == [1, 2, 3, 4, 5, 6]
    assert events[-1].kind == "final"


async def test_the_reader_keeps_rows_apart(redis: Redis, settings: Settings) -> None:
    _, m, _, d = await running_request(redis, settings)
    rid = m.id
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.reply_ttl_s)
    for _attempt in range(2):
        for i in range(3):
            for row in (0, 1):
                writer.delta(d, DeltaEvent(i=i, text="x", token_ids=[i], row=row))
                await writer.flush()
    await redis.xadd(KEYS.reply(rid), {"kind": "final", "data": done_result().model_dump_json()})
    events = await _collect(redis, rid)
    got = sorted((e.delta.row, e.delta.i) for e in events if e.kind == "delta")
    assert got == [(row, i) for row in (0, 1) for i in range(3)]


async def test_reading_resumes_after_a_given_event(redis: Redis, settings: Settings) -> None:
    _, m, _, d = await running_request(redis, settings)
    rid = m.id
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.reply_ttl_s)
    for i in range(4):
        writer.delta(d, DeltaEvent(i=i, text=f"<{i}>", token_ids=[i]))
        await writer.flush()
    await redis.xadd(KEYS.reply(rid), {"kind": "final", "data": done_result().model_dump_json()})
    first = await _collect(redis, rid)
    last_seen = first[1].entry_id  # the client saw tokens 0 and 1, then lost the connection
    assert await resume_index(redis, MODEL, rid, last_seen) == {0: 2}
    rest = await _collect(redis, rid, after=last_seen, next_index=2)
    assert [e.delta.i for e in rest if e.kind == "delta"] == [2, 3]
    assert rest[-1].kind == "final"


async def test_buffered_contiguous_deltas_are_joined(redis: Redis, settings: Settings) -> None:
    _, m, _, d = await running_request(redis, settings)
    rid = m.id
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.reply_ttl_s)
    for i in range(3):
        writer.delta(d, DeltaEvent(i=i, text=f"<{i}>", token_ids=[i]))
    writer.delta(d, DeltaEvent(i=0, text="r1", token_ids=[7], row=1))
    writer.delta(d, DeltaEvent(i=5, text="<5>", token_ids=[5]))  # not contiguous: kept apart
    await writer.flush()
    entries = [DeltaEvent.model_validate_json(f["data"]) for _, f in await redis.xrange(KEYS.reply(rid))]
    # (index 5 would leave a hole at 3 and 4: never written past, issue 28 defect 2)
    assert [(e.row, e.i, e.text, e.token_ids) for e in entries] == [
        (0, 0, "<0><1><2>", [0, 1, 2]), (1, 0, "r1", [7])]


async def test_the_reader_gives_up_after_the_idle_timeout(redis: Redis) -> None:
    assert await read_events(redis, "req-silent", idle_timeout_s=0.2) == []


class _LosesFirstCancel:
    """A client whose first script call loses a cancel, as redis-py 8 can on Python 3.11
    (asyncio.wait_for around the socket write returns its result when the cancel and the
    end of the write meet, CPython gh-86296)."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self.entered = asyncio.Event()
        self.swallowed: list[bool] = []

    def register_script(self, script: str):
        return self.redis.register_script(script)

    async def script_load(self, script: str) -> str:
        return await self.redis.script_load(script)

    async def evalsha(self, *args):
        if not self.swallowed:
            self.entered.set()
            try:
                await asyncio.sleep(3600)  # the write in flight when the writer is closed
            except asyncio.CancelledError:
                self.swallowed.append(True)
        return await self.redis.evalsha(*args)


async def test_closing_the_reply_writer_survives_a_lost_cancel(redis: Redis, settings: Settings) -> None:
    _, m, _, d = await running_request(redis, settings)
    client = _LosesFirstCancel(redis)
    writer = ReplyWriter(client, MODEL, reply_ttl_s=settings.reply_ttl_s)  # type: ignore[arg-type]
    writer.start()
    writer.delta(d, DeltaEvent(i=0, text="a", token_ids=[1]))
    await asyncio.wait_for(client.entered.wait(), 5)
    try:
        await asyncio.wait_for(writer.close(), 3)
    except TimeoutError:
        pytest.fail("ReplyWriter.close() did not return within 3 s: its task lost its cancel")
    assert client.swallowed == [True]
    assert await redis.xlen(KEYS.reply(m.id)) == 1


async def test_a_fenced_worker_writes_no_tokens(redis: Redis, settings: Settings) -> None:
    """A worker frozen past its lease wakes up with tokens in its buffer: once the entry is
    another worker's, those tokens must not land beside the new owner's."""
    _, m, _, d = await running_request(redis, settings, "w1")
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.reply_ttl_s)
    writer.delta(d, DeltaEvent(i=0, text="a", token_ids=[1]))
    await writer.flush()
    await take_over(redis, settings, d)
    writer.delta(d, DeltaEvent(i=1, text="b", token_ids=[2]))
    await writer.flush()
    assert [DeltaEvent.model_validate_json(f["data"]).text for _, f in await redis.xrange(KEYS.reply(m.id))] == ["a"]


async def test_delivered_tokens_are_the_contiguous_prefix_of_each_row(redis: Redis, settings: Settings) -> None:
    _, m, _, d = await running_request(redis, settings)
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.reply_ttl_s)
    for ev in [DeltaEvent(i=0, text="a", token_ids=[1, 2]), DeltaEvent(i=0, text="x", token_ids=[9], row=1),
               DeltaEvent(i=2, text="b", token_ids=[3], finish="stop"),
               DeltaEvent(i=1, text="dup", token_ids=[4]),  # overlaps what is there: not part of it
               DeltaEvent(i=3, text="c", token_ids=[5])]:  # after the finish: not part of it either
        writer.delta(d, ev)
        await writer.flush()
    rows = await delivered(redis, MODEL, m.id)
    assert (rows[0].token_ids, "".join(rows[0].text), rows[0].finish) == ([1, 2, 3], "ab", "stop")
    assert (rows[1].token_ids, rows[1].text, rows[1].finish) == ([9], ["x"], None)
    assert await delivered(redis, MODEL, "req-none") == {}


async def test_a_resent_flush_writes_no_token_twice(redis: Redis, settings: Settings) -> None:
    """redis-py resends a pipeline whose reply was lost (Redis died after running it): the
    deltas it carried are on the stream already and must not be written again."""
    _, m, _, d = await running_request(redis, settings)
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.reply_ttl_s)
    for _ in range(2):  # the same pipeline, twice
        writer.delta(d, DeltaEvent(i=0, text="a", token_ids=[1, 2]))
        writer.delta(d, DeltaEvent(i=0, text="x", token_ids=[9], row=1))
        await writer.flush()
    writer.delta(d, DeltaEvent(i=2, text="b", token_ids=[3]))
    await writer.flush()
    entries = [DeltaEvent.model_validate_json(f["data"]) for _, f in await redis.xrange(KEYS.reply(m.id))]
    assert [(e.row, e.i, e.text) for e in entries] == [(0, 0, "a"), (1, 0, "x"), (0, 2, "b")]


async def test_a_failed_flush_keeps_its_deltas_for_the_next_one(redis: Redis, settings: Settings) -> None:
    """Redis went away mid-flush: the deltas stay buffered and land with the next flush, so
    the stream never has a hole. Redis restarted without its scripts (NOSCRIPT): the flush
    loads reply.lua again and writes."""
    _, m, _, d = await running_request(redis, settings)
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.reply_ttl_s)
    await failing_flush(writer, d, DeltaEvent(i=0, text="a", token_ids=[1]), lands=False)
    writer.delta(d, DeltaEvent(i=1, text="b", token_ids=[2]))
    await writer.flush()
    await redis.script_flush()  # as after a restart
    writer.delta(d, DeltaEvent(i=2, text="c", token_ids=[3]))
    await writer.flush()
    entries = [DeltaEvent.model_validate_json(f["data"]) for _, f in await redis.xrange(KEYS.reply(m.id))]
    assert "".join(e.text for e in entries) == "abc"


async def test_an_earlier_attempts_buffered_deltas_are_not_written_under_a_later_one(
        redis: Redis, settings: Settings) -> None:
    """A chaos run on a cluster found it: a worker's flush failed (its Redis primary died), so
    it gave the request up with deltas still buffered; after the failover the same worker
    (same consumer name, so it passed the ownership check) took the request over as attempt 2,
    which resumed from the stream, and then flushed attempt 1's leftovers first: attempt 2's
    tokens at those indices were dropped and the final disagreed with the stream."""
    _, m, c, d = await running_request(redis, settings)
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.reply_ttl_s)
    writer.delta(d, DeltaEvent(i=0, text=" a0", token_ids=[0]))
    await writer.flush()
    writer.delta(d, DeltaEvent(i=1, text=" a1", token_ids=[1]))  # buffered: the flush "failed"
    c.release(d)  # given up; its lease lapses and the same consumer takes it over
    await redis.xclaim(d.stream, GROUP, d.consumer, 0, [d.entry_id], idle=10_000_000, justid=True)
    await asyncio.sleep(c.reclaim_scan_s)  # its last scan for lapsed leases found none: it rests
    (again,) = await c.fetch(1, 100)
    assert again.attempt == 2 and await c.start(again) == "run"
    resumed = (await delivered(redis, MODEL, m.id))[0]
    assert resumed.token_ids == [0]  # attempt 2 goes on from index 1
    writer.delta(again, DeltaEvent(i=1, text=" b1", token_ids=[7], attempt=2))
    await writer.flush()  # attempt 1's leftover first, then attempt 2's
    entries = [DeltaEvent.model_validate_json(f["data"]) for _, f in await redis.xrange(KEYS.reply(m.id))]
    assert [(e.attempt, e.i, e.text) for e in entries] == [(1, 0, " a0"), (2, 1, " b1")]


async def test_deltas_of_two_attempts_are_never_joined(redis: Redis, settings: Settings) -> None:
    """A lagging writer joins a row's contiguous deltas, but never across attempts: attempt 1's
    leftover and attempt 2's next token stay apart, so the earlier one is fenced on its own and
    the later one is written under its own attempt."""
    _, m, c, d = await running_request(redis, settings)
    again = dataclasses.replace(d, attempt=2)
    joined = _coalesce([(d, DeltaEvent(i=0, text=" a0", token_ids=[0])),
                        (again, DeltaEvent(i=1, text=" b1", token_ids=[1], attempt=2))])
    assert [(o.attempt, ev.attempt, ev.i) for o, ev in joined] == [(1, 1, 0), (2, 2, 1)]
