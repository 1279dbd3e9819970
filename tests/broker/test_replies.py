"""Reply channels: the writer, the reader's skipping and resuming, closing under a lost cancel."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from redis.asyncio import Redis

from sluice.broker.keys import GROUP
from sluice.broker.replies import ReplyWriter, _coalesce, delivered
from sluice.broker.reply_router import resume_index
from sluice.config.settings import Settings
from sluice.protocol.messages import DeltaEvent, TokenLogprob
from tests.broker.helpers import (
    KEYS,
    MODEL,
    done_result,
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


async def _failing_flush(writer: ReplyWriter, d, event: DeltaEvent, *, lands: bool) -> None:
    """Buffer `event` and flush it into a connection error: Redis went away before running the
    pipeline, or (`lands`) ran it and the answer was lost."""
    real = writer._write

    async def failing(calls):
        if lands:
            await real(calls)
        raise ConnectionError("the answer was lost" if lands else "Redis went away")

    writer._write = failing
    writer.delta(d, event)
    try:
        with pytest.raises(ConnectionError):
            await writer.flush()
    finally:
        writer._write = real


async def test_a_failed_flush_keeps_its_deltas_for_the_next_one(redis: Redis, settings: Settings) -> None:
    """Redis went away mid-flush: the deltas stay buffered and land with the next flush, so
    the stream never has a hole. Redis restarted without its scripts (NOSCRIPT): the flush
    loads reply.lua again and writes."""
    _, m, _, d = await running_request(redis, settings)
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.reply_ttl_s)
    await _failing_flush(writer, d, DeltaEvent(i=0, text="a", token_ids=[1]), lands=False)
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


async def _lose_last(redis: Redis, rid: str, n: int) -> None:
    """What a failover does to a stream whose primary died before its replica had the last `n`
    entries: they are gone, and so is the status's count of them (both written by one script)."""
    entries = await redis.xrange(KEYS.reply(rid))
    kept = [DeltaEvent.model_validate_json(f["data"]) for _, f in entries[:-n]]
    await redis.xdel(KEYS.reply(rid), *[eid for eid, _ in entries[-n:]])
    await redis.hset(KEYS.status(rid), "next:0", kept[-1].i + len(kept[-1].token_ids) if kept else 0)


async def test_deltas_a_failover_lost_are_sent_again(redis: Redis, settings: Settings) -> None:
    """The old primary acknowledged deltas its replica never had: after the failover the same
    worker goes on from where it was. Its next delta would leave a hole in the stream (a chaos
    run on a cluster saw indices 53 to 59 missing); reply.lua refuses it and names the index
    the stream ends at, and the writer sends this attempt's deltas again from there."""
    _, m, _, d = await running_request(redis, settings)
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.reply_ttl_s)
    for i, word in enumerate([" a", " b", " c"]):
        writer.delta(d, DeltaEvent(i=i, text=word, token_ids=[i]))
        await writer.flush()  # one entry each
    await _lose_last(redis, m.id, 2)
    writer.delta(d, DeltaEvent(i=3, text=" d", token_ids=[3]))
    writer.delta(d, DeltaEvent(i=0, text=" x", token_ids=[9], row=1))  # another row, written as it is
    await writer.flush()
    rows = await delivered(redis, MODEL, m.id)
    assert (rows[0].token_ids, "".join(rows[0].text)) == ([0, 1, 2, 3], " a b c d")
    assert rows[1].token_ids == [9]
    entries = [DeltaEvent.model_validate_json(f["data"]) for _, f in await redis.xrange(KEYS.reply(m.id))]
    assert [(e.row, e.i) for e in entries] == [(0, 0), (1, 0), (0, 1)]  # the resend: one entry, 1 to 3


async def test_a_hole_the_attempt_cannot_fill_is_never_written_past(redis: Redis, settings: Settings) -> None:
    """This attempt resumed after tokens that a failover then lost (it never had them to send
    again): nothing is written past the hole, the flush ends, and the commit does not go
    through over it (issue 28, defect 2): a retry resumes from where the stream ends."""
    _, m, c, d = await running_request(redis, settings)
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.reply_ttl_s)
    for i in range(3):  # an earlier attempt's tokens (this one resumed after them)
        await redis.xadd(KEYS.reply(m.id), {"kind": "delta", "data": DeltaEvent(i=i, text="p", token_ids=[i])
                                            .model_dump_json()})
    await redis.hset(KEYS.status(m.id), "next:0", 3)
    await _lose_last(redis, m.id, 2)
    writer.delta(d, DeltaEvent(i=3, text=" d", token_ids=[3]))
    await asyncio.wait_for(writer.flush(), 10)
    entries = [DeltaEvent.model_validate_json(f["data"]) for _, f in await redis.xrange(KEYS.reply(m.id))]
    assert [e.i for e in entries] == [0]
    assert await redis.hget(KEYS.status(m.id), "next:0") == "1"
    final = done_result("ppp d")
    final.output.num_output_tokens = 4
    assert await asyncio.wait_for(writer.commit(d, final, c.commit), 10) is False
    assert await redis.hget(KEYS.status(m.id), "state") == "running"
    assert (await redis.xpending(KEYS.requests, GROUP))["pending"] == 1  # left for a retry


async def test_a_tail_a_failover_lost_is_sent_again_before_the_final(redis: Redis, settings: Settings) -> None:
    """The last deltas lost (a chaos run on a cluster saw a stream end 4 tokens before its
    final's text): no later delta finds the hole, so the commit does. It answers the index
    the stream ends at, writes nothing, and the writer sends the tail again and commits."""
    _, m, c, d = await running_request(redis, settings)
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.reply_ttl_s)
    for i, word in enumerate([" a", " b", " c"]):
        writer.delta(d, DeltaEvent(i=i, text=word, token_ids=[i], finish="length" if i == 2 else None))
        await writer.flush()
    await _lose_last(redis, m.id, 2)
    final = done_result(" a b c")
    final.output.num_output_tokens = 3
    assert await writer.commit(d, final, c.commit)
    entries = [(f["kind"], f["data"]) for _, f in await redis.xrange(KEYS.reply(m.id))]
    assert [k for k, _ in entries] == ["delta", "delta", "final"]
    row = (await delivered(redis, MODEL, m.id))[0]
    assert (row.token_ids, "".join(row.text), row.finish) == ([0, 1, 2], " a b c", "length")


async def test_a_tail_that_cannot_be_sent_again_is_never_committed_over(
        redis: Redis, settings: Settings) -> None:
    """A commit never goes through over a hole (issue 28, defect 2): the request stays
    unfinished, its entry pending, for a retry that resumes from where the stream ends."""
    _, m, c, d = await running_request(redis, settings)
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.reply_ttl_s)
    final = done_result()  # 2 tokens, never written by this writer: the stream stays short
    assert await asyncio.wait_for(writer.commit(d, final, c.commit), 10) is False
    assert await redis.hget(KEYS.status(m.id), "state") == "running"
    assert (await redis.xpending(KEYS.requests, GROUP))["pending"] == 1


async def test_a_flush_that_landed_unanswered_and_is_joined_with_later_deltas_leaves_no_hole(
        redis: Redis, settings: Settings) -> None:
    """A chaos run on a cluster found it: a flush ran on the primary but its answer was lost,
    so its deltas went back to the buffer and were joined with the next ones. The joined delta
    starts below the stream's end: dropped whole, it took the new tokens with it (a hole at
    indices 105 to 108). Refused instead, the writer sends the engine's own deltas from the end."""
    _, m, _, d = await running_request(redis, settings)
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.reply_ttl_s)
    writer.delta(d, DeltaEvent(i=0, text=" a", token_ids=[0]))
    await writer.flush()
    await _failing_flush(writer, d, DeltaEvent(i=1, text=" b", token_ids=[1]), lands=True)
    writer.delta(d, DeltaEvent(i=2, text=" c", token_ids=[2]))
    await writer.flush()  # " b c" from index 1: the stream ends at 2
    row = (await delivered(redis, MODEL, m.id))[0]
    assert (row.token_ids, "".join(row.text)) == ([0, 1, 2], " a b c")


async def test_the_deltas_kept_for_a_resend_are_bounded(redis: Redis, settings: Settings) -> None:
    """A long generation keeps at most _KEPT deltas per row (the latest): a failover loses the
    last moments, and a resend from further back is let through as a hole the attempt cannot fill."""
    from sluice.broker.replies import _KEPT

    _, m, _, d = await running_request(redis, settings)
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.reply_ttl_s)
    for i in range(_KEPT + 100):
        writer.delta(d, DeltaEvent(i=i, text=" t", token_ids=[i]))
    await writer.flush()
    kept = d.sent.rows[0]
    assert len(kept) == _KEPT and min(kept) == 100 and max(kept) == _KEPT + 99
    assert (await delivered(redis, MODEL, m.id))[0].token_ids == list(range(_KEPT + 100))


async def test_the_deltas_kept_for_a_resend_are_out_of_the_garbage_collectors_reach(redis: Redis,
                                                                                    settings: Settings) -> None:
    """Kept deltas are plain tuples the collector stops tracking: a worker keeps every running
    request's, and tracked they made each full collection walk them all (a pause of tens of ms
    on the worker's loop under load). A resend still rebuilds each delta whole."""
    import gc

    from sluice.broker.replies import _event

    _, m, _, d = await running_request(redis, settings)
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.reply_ttl_s)
    events = [DeltaEvent(i=i, text=f" t{i}", token_ids=[i], finish="length" if i == 9 else None) for i in range(10)]
    logprobs = [TokenLogprob(token=" t3", logprob=-0.5, top=[(" t3", -0.5)])]  # (kept as they are: tracked)
    events[3] = events[3].model_copy(update={"logprobs": logprobs})
    for ev in events:
        writer.delta(d, ev)
    gc.collect()  # a collection untracks a tuple whose items are untracked: the ids' tuple,
    gc.collect()  # then (by the next, long before a delta would reach the oldest generation) the delta's
    kept = d.sent.rows[0]
    assert not any(gc.is_tracked(kept[i]) for i in range(10) if i != 3)
    assert [_event(kept[i]) for i in range(10)] == events


async def test_deltas_of_two_attempts_are_never_joined(redis: Redis, settings: Settings) -> None:
    """A lagging writer joins a row's contiguous deltas, but never across attempts: attempt 1's
    leftover and attempt 2's next token stay apart, so the earlier one is fenced on its own and
    the later one is written under its own attempt."""
    _, m, c, d = await running_request(redis, settings)
    again = dataclasses.replace(d, attempt=2)
    joined = _coalesce([(d, DeltaEvent(i=0, text=" a0", token_ids=[0])),
                        (again, DeltaEvent(i=1, text=" b1", token_ids=[1], attempt=2))])
    assert [(o.attempt, ev.attempt, ev.i) for o, ev in joined] == [(1, 1, 0), (2, 2, 1)]


async def test_a_hole_the_attempt_cannot_fill_is_filled_by_the_next_attempt(redis: Redis, settings: Settings) -> None:
    """A commit never goes through over a hole (issue 28, defect 2), and the request still ends
    whole: attempt 2 resumed after tokens a failover then lost, so it cannot fill the hole and
    does not commit; attempt 3 resumes from where the stream ends, and the stream it leaves is
    its final's text."""
    words = [f" w{i}" for i in range(8)]

    async def write(d, start: int) -> ReplyWriter:
        writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.status_ttl_s)
        for i in range(start, len(words)):
            writer.delta(d, DeltaEvent(i=i, text=words[i], token_ids=[i], attempt=d.attempt,
                                       finish="length" if i == len(words) - 1 else None))
            await writer.flush()
        return writer

    _, m, c1, d1 = await running_request(redis, settings)
    await write(d1, 0)
    await _lose_last(redis, m.id, 3)  # attempt 1's worker died; keep 5 tokens for now
    c2, d2 = await take_over(redis, settings, d1, "w2")
    resumed = len((await delivered(redis, MODEL, m.id))[0].token_ids)
    assert resumed == 5
    await _lose_last(redis, m.id, 2)  # a failover loses tokens 3 and 4 after attempt 2 read them
    final = done_result("".join(words))
    final.output.num_output_tokens = len(words)
    writer = await write(d2, resumed)
    assert await asyncio.wait_for(writer.commit(d2, final, c2.commit), 10) is False
    assert await redis.hget(KEYS.status(m.id), "state") == "running"
    c3, d3 = await take_over(redis, settings, d2, "w3")
    row = (await delivered(redis, MODEL, m.id))[0]
    assert row.token_ids == [0, 1, 2]
    writer = await write(d3, len(row.token_ids))
    assert await asyncio.wait_for(writer.commit(d3, final, c3.commit), 10) is True
    row = (await delivered(redis, MODEL, m.id))[0]
    assert ("".join(row.text), row.token_ids) == (final.output.text, list(range(len(words))))
