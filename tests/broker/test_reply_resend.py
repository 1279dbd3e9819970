"""Resending after a failover: deltas the old primary acknowledged and its replica never had are
sent again from where the stream ends, a hole an attempt cannot fill is never written or
committed past, and the deltas kept for a resend are bounded and out of the garbage
collector's reach."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis

from sluice.broker.keys import GROUP
from sluice.broker.replies.writer import ReplyWriter, delivered
from sluice.config.settings import Settings
from sluice.protocol.messages import DeltaEvent, TokenLogprob
from tests.broker.helpers import KEYS, MODEL, done_result, failing_flush, running_request, take_over


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
    await failing_flush(writer, d, DeltaEvent(i=1, text=" b", token_ids=[1]), lands=True)
    writer.delta(d, DeltaEvent(i=2, text=" c", token_ids=[2]))
    await writer.flush()  # " b c" from index 1: the stream ends at 2
    row = (await delivered(redis, MODEL, m.id))[0]
    assert (row.token_ids, "".join(row.text)) == ([0, 1, 2], " a b c")


async def test_the_deltas_kept_for_a_resend_are_bounded(redis: Redis, settings: Settings) -> None:
    """A long generation keeps at most _KEPT deltas per row (the latest): a failover loses the
    last moments, and a resend from further back is let through as a hole the attempt cannot fill."""
    from sluice.broker.replies.writer import _KEPT

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

    from sluice.broker.replies.writer import _event

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
