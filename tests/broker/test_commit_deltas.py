"""A request's last deltas ride on its commit: one script call writes them and the final, with
the same guarantees as a flush (fencing, no token twice, no hole, nothing after a final)."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis

from sluice.broker.keys import GROUP
from sluice.broker.replies.writer import ReplyWriter, delivered
from sluice.config.settings import Settings
from sluice.protocol.messages import DeltaEvent
from tests.broker.helpers import KEYS, MODEL, done_result, running_request, take_over


async def _entries(redis: Redis, rid: str) -> list[tuple[str, str]]:
    return [(f["kind"], f["data"]) for _, f in await redis.xrange(KEYS.reply(rid))]


def _three(writer: ReplyWriter, d, start: int = 0) -> None:
    for i, word in enumerate([" a", " b", " c"], start):
        writer.delta(d, DeltaEvent(i=i, text=word, token_ids=[i], finish="length" if i == start + 2 else None))


async def test_the_last_deltas_and_the_final_go_in_one_call(redis: Redis, settings: Settings) -> None:
    _, m, c, d = await running_request(redis, settings)
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.reply_ttl_s)
    _three(writer, d)  # buffered: no flush ran
    final = done_result(" a b c")
    final.output.num_output_tokens = 3
    flushes: list = []
    real = writer._write

    async def counted(calls):
        flushes.append(calls)
        return await real(calls)

    writer._write = counted
    assert await writer.commit(d, final, c.commit)
    assert flushes == [] and writer._buffer == []  # no flush: the commit wrote them
    entries = await _entries(redis, m.id)
    assert [k for k, _ in entries] == ["delta", "final"]  # joined into one delta, then the final
    row = (await delivered(redis, MODEL, m.id))[0]
    assert (row.token_ids, "".join(row.text), row.finish) == ([0, 1, 2], " a b c", "length")
    status = await redis.hgetall(KEYS.status(m.id))
    assert status["state"] == "done" and not [f for f in status if f.startswith("next:")]
    assert 0 < await redis.ttl(KEYS.reply(m.id)) <= settings.reply_ttl_s


async def test_a_commit_resent_after_a_lost_answer_writes_no_token_twice(redis: Redis, settings: Settings) -> None:
    """The commit ran but its answer was lost (Redis died after running it): sent again, it
    finds the request final and writes neither the deltas nor a second final."""
    _, m, c, d = await running_request(redis, settings)
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.reply_ttl_s)
    _three(writer, d)
    final = done_result(" a b c")
    final.output.num_output_tokens = 3
    real = c.commit

    async def lost(*args):
        await real(*args)
        raise ConnectionError("the answer was lost")

    try:
        await writer.commit(d, final, lost)
    except ConnectionError:
        pass
    assert len(writer._buffer) == 3  # not known to be written: kept
    await redis.xclaim(d.stream, GROUP, d.consumer, 0, [d.entry_id], justid=True)  # still pending here
    assert [k for k, _ in await _entries(redis, m.id)] == ["delta", "final"]
    await writer.flush()  # the writer sends them: after the final, nothing is written
    assert [k for k, _ in await _entries(redis, m.id)] == ["delta", "final"]


async def test_deltas_past_a_lost_tail_are_refused_and_sent_again(redis: Redis, settings: Settings) -> None:
    """A failover lost the stream's last two entries; the deltas riding on the commit start
    past the hole: refused (nothing written, no final), they go again from where the stream
    ends, and the commit then lands whole."""
    _, m, c, d = await running_request(redis, settings)
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.reply_ttl_s)
    for i in range(3):
        writer.delta(d, DeltaEvent(i=i, text=f" t{i}", token_ids=[i]))
        await writer.flush()
    entries = await redis.xrange(KEYS.reply(m.id))
    await redis.xdel(KEYS.reply(m.id), *[eid for eid, _ in entries[-2:]])
    await redis.hset(KEYS.status(m.id), "next:0", 1)
    writer.delta(d, DeltaEvent(i=3, text=" t3", token_ids=[3], finish="length"))
    final = done_result(" t0 t1 t2 t3")
    final.output.num_output_tokens = 4
    assert await writer.commit(d, final, c.commit)
    row = (await delivered(redis, MODEL, m.id))[0]
    assert (row.token_ids, "".join(row.text), row.finish) == ([0, 1, 2, 3], " t0 t1 t2 t3", "length")
    assert [k for k, _ in await _entries(redis, m.id)][-1] == "final"


async def test_a_fenced_commit_writes_no_deltas(redis: Redis, settings: Settings) -> None:
    _, m, c, d = await running_request(redis, settings, "w1")
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.reply_ttl_s)
    _three(writer, d)
    await take_over(redis, settings, d)
    assert not await writer.commit(d, done_result(" a b c"), c.commit)
    assert await redis.xlen(KEYS.reply(m.id)) == 0
    assert await redis.hget(KEYS.status(m.id), "state") == "running"


async def test_no_delta_lands_after_a_final(redis: Redis, settings: Settings) -> None:
    """The request went final while its worker still held the entry (expired past its deadline
    by the housekeeping): the worker's buffered tokens are written neither by a flush nor by
    its commit, which acknowledges the entry and leaves the first final alone."""
    _, m, c, d = await running_request(redis, settings)
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.reply_ttl_s)
    writer.delta(d, DeltaEvent(i=0, text=" a", token_ids=[0]))
    await writer.flush()
    await redis.hset(KEYS.status(m.id), "state", "expired")
    writer.delta(d, DeltaEvent(i=1, text=" b", token_ids=[1]))
    await asyncio.wait_for(writer.flush(), 10)
    writer.delta(d, DeltaEvent(i=2, text=" c", token_ids=[2]))
    assert not await writer.commit(d, done_result(" a b c"), c.commit)  # acknowledged, not written
    assert [k for k, _ in await _entries(redis, m.id)] == ["delta"]
    assert await redis.hget(KEYS.status(m.id), "state") == "expired"
    assert await redis.xpending(d.stream, GROUP) == {"pending": 0, "min": None, "max": None, "consumers": []}
