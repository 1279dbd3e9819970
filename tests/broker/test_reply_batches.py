"""The reply writer's batches (issue 32): one reply.lua call carries many requests' deltas,
each request fenced and made idempotent on its own; a flush starts as soon as the one before
has returned, so a lone token goes at once and no token waits longer than one flush."""

from __future__ import annotations

import asyncio
import time

from redis.asyncio import Redis

from sluice.broker.delivery.consumer import Delivery
from sluice.broker.replies.calls import Reply
from sluice.broker.replies.router import resume_index
from sluice.broker.replies.writer import ReplyEvent, ReplyWriter, delivered, heard_cancel
from sluice.config.settings import Settings
from sluice.protocol.messages import DeltaEvent, RequestMessage
from tests.broker.helpers import (
    KEYS,
    MODEL,
    admission,
    cancels,
    done_result,
    read_events,
    ready_consumer,
    submit_n,
    take_over,
)


async def _running(redis: Redis, settings: Settings, n: int):
    """`n` requests admitted, fetched and started by one consumer: (consumer, messages, deliveries)."""
    messages = await submit_n(admission(redis, settings), n)
    c = await ready_consumer(redis, settings)
    ds = await c.fetch(n, 1000)
    assert len(ds) == n
    for d in ds:
        assert await c.start(d) == "run"
    by_id = {d.message.id: d for d in ds}
    return c, messages, [by_id[m.id] for m in messages]


class _Calls:
    """Records the reply.lua calls a writer makes: per call, the requests (reply keys) it carried."""

    def __init__(self, writer: ReplyWriter) -> None:
        self.real, self.calls = writer._call, []
        writer._call = self  # type: ignore[method-assign]

    async def __call__(self, call: Reply) -> list[object]:
        self.calls.append([request.reply for request in call.requests])
        return await self.real(call)


def _token(d: Delivery, i: int, **kw) -> DeltaEvent:
    return DeltaEvent(i=i, text=f" {d.message.id[-4:]}.{i}", token_ids=[i], attempt=d.attempt, **kw)


async def _texts(redis: Redis, m: RequestMessage) -> list[str]:
    return [DeltaEvent.model_validate_json(f["data"]).text for _, f in await redis.xrange(KEYS.reply(m.id))
            if f["kind"] == "delta"]


async def test_a_fenced_request_in_a_batch_writes_nothing_while_the_others_are_written(
        redis: Redis, settings: Settings) -> None:
    """A worker frozen past one request's lease wakes with tokens of it and of two requests it
    still holds, all in one flush: the one call writes the two and nothing of the third."""
    _, ms, (a, b, fenced) = await _running(redis, settings, 3)
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.status_ttl_s)
    calls = _Calls(writer)
    for d in (a, b, fenced):
        writer.delta(d, _token(d, 0))
    await writer.flush()
    _, again = await take_over(redis, settings, fenced)
    for d in (a, fenced, b):
        writer.delta(d, _token(d, 1))
        writer.delta(d, _token(d, 2))
    await writer.flush()
    assert len(calls.calls) == 2 and all(len(c) == 3 for c in calls.calls)  # one call per flush, all three
    assert await _texts(redis, ms[0]) == [_token(a, 0).text, _token(a, 1).text + _token(a, 2).text]
    assert await _texts(redis, ms[1]) == [_token(b, 0).text, _token(b, 1).text + _token(b, 2).text]
    assert await _texts(redis, ms[2]) == [_token(fenced, 0).text]  # its successor's tokens go from index 1
    assert (await delivered(redis, MODEL, ms[2].id))[0].token_ids == [0]
    writer.delta(again, _token(again, 1))  # the successor, in the same writer's next call, is written
    writer.delta(a, _token(a, 3))
    await writer.flush()
    assert (await delivered(redis, MODEL, ms[2].id))[0].token_ids == [0, 1]
    assert calls.calls[-1] == [KEYS.reply(ms[2].id), KEYS.reply(ms[0].id)]


async def test_a_batch_sent_again_after_a_dropped_connection_writes_no_delta_twice(
        redis: Redis, settings: Settings) -> None:
    """The call ran but its answer was lost (the connection dropped): the writer keeps the
    deltas and sends them again, joined with the next ones; no delta of any request of the
    batch is written twice, and none is missing."""
    _, ms, ds = await _running(redis, settings, 4)
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.status_ttl_s)
    real = writer._call
    dropped: list[bool] = []

    async def lands_unanswered(call: Reply) -> list[object]:
        await real(call)
        if not dropped:
            dropped.append(True)
            raise ConnectionError("the connection dropped with the answer on its way")
        return await real(call)  # (what redis-py's retry does: the same call again)

    writer._call = lands_unanswered  # type: ignore[method-assign]
    for d in ds:
        writer.delta(d, _token(d, 0))
        writer.delta(d, _token(d, 1))
    try:
        await writer.flush()
    except ConnectionError:
        pass
    assert dropped == [True]
    for d in ds:
        writer.delta(d, _token(d, 2, finish="length"))
    await writer.flush()
    for m, d in zip(ms, ds):
        row = (await delivered(redis, MODEL, m.id))[0]
        assert row.token_ids == [0, 1, 2] and row.finish == "length"
        assert "".join(row.text) == "".join(_token(d, i).text for i in range(3))
        indices = [DeltaEvent.model_validate_json(f["data"]).i for _, f in await redis.xrange(KEYS.reply(m.id))]
        assert len(indices) == len(set(indices))  # no entry written twice


async def test_readers_joining_and_resuming_see_exactly_the_stream_of_batched_writes(
        redis: Redis, settings: Settings) -> None:
    """Many requests' tokens written together, call after call: a reader from the start, a
    second reader that joins mid-way and a reader resumed after an event it got (Last-Event-ID)
    each see exactly the stream, in order, each token once."""
    c, ms, ds = await _running(redis, settings, 6)
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.status_ttl_s)
    calls = _Calls(writer)
    target, d = ms[2], ds[2]
    first = asyncio.create_task(read_events(redis, target.id, idle_timeout_s=20))
    joined: asyncio.Task[list[ReplyEvent]] | None = None
    steps = 12
    for step in range(steps):
        for each in ds:
            writer.delta(each, _token(each, step, finish="length" if step == steps - 1 else None))
        await writer.flush()
        if step == steps // 2:
            joined = asyncio.create_task(read_events(redis, target.id, idle_timeout_s=20))
    assert all(len(call) == len(ds) for call in calls.calls)  # every flush: every request in one call
    final = done_result("".join(_token(d, i).text for i in range(steps)))
    final.output.num_output_tokens = steps
    assert await writer.commit(d, final, c.commit)
    entries = await redis.xrange(KEYS.reply(target.id))
    middle = entries[len(entries) // 2][0]
    next_index = await resume_index(redis, MODEL, target.id, middle)
    resumed = await read_events(redis, target.id, after=middle, next_index=next_index, idle_timeout_s=20)
    assert joined is not None
    whole = [eid for eid, _ in entries]
    for events in (await first, await joined):
        assert [e.entry_id for e in events] == whole
        assert [t for e in events if e.delta for t in e.delta.token_ids] == list(range(steps))
        assert events[-1].final == final
    assert [e.entry_id for e in resumed] == whole[whole.index(middle) + 1:]
    got = [t for e in resumed if e.delta for t in e.delta.token_ids]
    assert got == list(range(next_index[0], steps))


async def test_a_lone_token_is_written_at_once_and_what_comes_meanwhile_goes_in_the_next_call(
        redis: Redis, settings: Settings) -> None:
    """By the order of calls, not by time: a token with nothing else buffered is written by the
    next turn of the writer (no timer, no waiting for other requests); tokens that arrive while
    that call is on its way wait for it, then all go in one call (no token waits longer than
    one flush)."""
    _, ms, (a, b, c) = await _running(redis, settings, 3)
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.status_ttl_s)
    calls = _Calls(writer)
    inner, release = calls.real, asyncio.Event()

    async def held(call: Reply) -> list[object]:
        await release.wait()  # the round trip, under the test's control
        return await inner(call)

    calls.real = held
    writer.start()
    try:
        writer.delta(a, _token(a, 0))
        for _ in range(50):  # turns of the loop, not time: no timer is waited for
            if calls.calls:
                break
            await asyncio.sleep(0)
        assert calls.calls == [[KEYS.reply(ms[0].id)]]  # a's token is on its way alone
        writer.delta(b, _token(b, 0))
        writer.delta(a, _token(a, 1))
        writer.delta(c, _token(c, 0))
        for _ in range(5):
            await asyncio.sleep(0)
        assert len(calls.calls) == 1  # the first call is still on its way: they wait for it
        release.set()
        while len(calls.calls) < 2:
            await asyncio.sleep(0)
        assert sorted(calls.calls[1]) == sorted(KEYS.reply(m.id) for m in ms)  # then all three, one call
        await writer.flush()
    finally:
        await writer.close()
    assert len(calls.calls) == 2
    assert (await delivered(redis, MODEL, ms[0].id))[0].token_ids == [0, 1]
    assert (await delivered(redis, MODEL, ms[2].id))[0].token_ids == [0]


async def test_a_flush_answers_which_requests_have_a_cancel(redis: Redis, settings: Settings) -> None:
    """The cancel watch rides on the writes: reply.lua answers, per request written, whether it
    has a cancel. A cancel sent after a request's last answer is not in it: that request counts
    as unheard once its answer is older than the watch's horizon, and its flag is read; a fenced
    request (nothing written) is never heard of."""
    c, ms, (a, b, fenced) = await _running(redis, settings, 3)
    cancel = cancels(redis, settings).cancel
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.status_ttl_s)
    runs = {d.message.id: d for d in (a, b, fenced)}
    assert heard_cancel(runs, float("-inf")) == (set(), list(runs))  # nothing written yet: every flag is read
    for d in (a, b, fenced):
        writer.delta(d, _token(d, 0))
    await writer.flush()
    before_cancel = time.monotonic()
    await take_over(redis, settings, fenced)
    assert await cancel(MODEL, ms[1].id) == "cancelling"  # b: after its answer said no cancel
    assert heard_cancel(runs, before_cancel - 60) == (set(), [])
    assert heard_cancel(runs, before_cancel) == (set(), list(runs))  # all answers older: all read
    assert await c.cancelled(heard_cancel(runs, before_cancel)[1]) == {ms[1].id}
    for d in (a, b, fenced):
        writer.delta(d, _token(d, 1))
    await writer.flush()
    assert heard_cancel(runs, before_cancel) == ({ms[1].id}, [ms[2].id])  # the fenced one: no answer
    assert (await delivered(redis, MODEL, ms[1].id))[0].token_ids == [0, 1]  # written all the same
