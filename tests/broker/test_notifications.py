"""The done listener: an announcement carries a small final (a waiter shows it without a read);
one heard before anyone watched its request is remembered, so
a submitter that waits only after admitting (`wait_final(fresh=True)`) skips the first status
read and still sees a request that finished in between at once."""

from __future__ import annotations

import asyncio
import contextlib
import time

from redis.asyncio import Redis

from sluice.api.lookup import RequestLookup
from sluice.broker.replies import notifications
from sluice.broker.replies.notifications import DoneListener
from sluice.config.settings import Settings
from sluice.protocol.messages import FinalResult
from tests.broker.helpers import KEYS, MODEL, admission, consumer, done_result, message, statuses


async def _until_live(done: DoneListener, rid: str) -> None:
    deadline = time.monotonic() + 10
    while not done.live(MODEL, rid):
        assert time.monotonic() < deadline, "the listener never subscribed"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def _listening(redis: Redis):
    done = DoneListener(redis, recheck_s=30)  # a missed announcement would cost 30 s
    done.start()
    try:
        yield done
    finally:
        await done.close()


async def _finish(redis: Redis, settings: Settings, m, **result) -> None:
    c = consumer(redis, settings)
    await c.ensure_groups()
    [d] = [d for d in await c.fetch(10, 200) if d.message.id == m.id]
    assert await c.start(d) == "run"
    assert await c.commit(d, done_result(**result))


async def test_an_announcement_before_the_watch_is_remembered(redis: Redis, settings: Settings) -> None:
    adm, status_reads = admission(redis, settings), statuses(redis, settings)
    first, m = message(), message()
    await adm.submit(first, max_queued=100)
    await adm.submit(m, max_queued=100)
    async with _listening(redis) as done:
        with done.watch(MODEL, first.id):  # subscribes the model's channel
            await _until_live(done, m.id)
        await _finish(redis, settings, m)  # announced while nobody watches it
        await asyncio.sleep(0.3)
        with done.watch(MODEL, m.id) as fut:  # a plain watch (a dead letter retried under its id) waits
            assert not fut.done()
        with done.watch(MODEL, m.id, recent=True) as fut:  # one for a request just admitted
            assert fut.done(), "an announcement heard before the watch was forgotten"
            assert FinalResult.model_validate_json(fut.result()).status.value == "done"  # with its final
        with done.watch(MODEL, first.id) as fut:
            assert not fut.done()  # not announced: nothing remembered
        lookup = RequestLookup(status_reads, done, None, settings.result_ttl_s)
        t0 = time.monotonic()
        status = await lookup.wait_final(MODEL, m.id, 20, fresh=True)
        assert status.final and time.monotonic() - t0 < 10  # not the 30 s re-check


async def test_an_announcement_carries_a_small_final(redis: Redis, settings: Settings, monkeypatch) -> None:
    adm, status_reads = admission(redis, settings), statuses(redis, settings)
    m = message()
    await adm.submit(m, max_queued=100)
    async with _listening(redis) as done:
        lookup = RequestLookup(status_reads, done, None, settings.result_ttl_s)
        with done.watch(MODEL, m.id) as fut:
            await _until_live(done, m.id)
            await _finish(redis, settings, m)
            final = await asyncio.wait_for(fut, 10)
        stored = await status_reads.status(MODEL, m.id)
        assert FinalResult.model_validate_json(final) == stored.result

        async def no_reads(*_):
            raise AssertionError("the status was read: the announcement carried the final")

        monkeypatch.setattr(status_reads, "status", no_reads)
        m2 = message()
        await adm.submit(m2, max_queued=100)
        waiting = asyncio.create_task(lookup.wait_final(MODEL, m2.id, 20, fresh=True))
        await asyncio.sleep(0.1)
        await _finish(redis, settings, m2)
        status = await asyncio.wait_for(waiting, 10)
        assert status.final and status.result.status.value == "done" and status.id == m2.id


async def test_a_large_final_is_announced_by_id_alone(redis: Redis, settings: Settings) -> None:
    adm, status_reads = admission(redis, settings), statuses(redis, settings)
    m = message()
    await adm.submit(m, max_queued=100)
    async with _listening(redis) as done:
        with done.watch(MODEL, m.id) as fut:
            await _until_live(done, m.id)
            await _finish(redis, settings, m, text="x" * 5000)
            assert await asyncio.wait_for(fut, 10) is None  # the waiter reads the status instead
        lookup = RequestLookup(status_reads, done, None, settings.result_ttl_s)
        status = await lookup.wait_final(MODEL, m.id, 20, fresh=True)
        assert status.result.output.text == "x" * 5000


async def test_a_fresh_wait_reads_the_status_first_while_the_listener_is_not_subscribed(
        redis: Redis, settings: Settings) -> None:
    adm, status_reads = admission(redis, settings), statuses(redis, settings)
    m = message()
    await adm.submit(m, max_queued=100)
    await _finish(redis, settings, m)  # announced before any listener subscribed
    done = DoneListener(redis, recheck_s=30)  # never started: hears nothing
    assert not done.live(MODEL, m.id)
    lookup = RequestLookup(status_reads, done, None, settings.result_ttl_s)
    t0 = time.monotonic()
    status = await asyncio.wait_for(lookup.wait_final(MODEL, m.id, 20, fresh=True), 10)
    assert status.final and time.monotonic() - t0 < 10
    assert await redis.exists(KEYS.status(m.id))


def test_the_remembered_announcements_are_bounded_in_bytes(redis: Redis, monkeypatch) -> None:
    monkeypatch.setattr(notifications, "_RECENT_BYTES", 10_000)
    done = DoneListener(redis)
    for i in range(100):
        done._remember(f"req-{i}", "x" * 1000)
    done._remember("req-99", "x" * 1000)  # heard again: counted once
    assert list(done._recent) == [f"req-{i}" for i in range(90, 100)] and done._recent_bytes == 10_000
    for i in range(20_000):
        done._remember(f"small-{i}", None)
    assert len(done._recent) == notifications._RECENT and done._recent_bytes == 0


async def test_an_announced_request_that_is_not_final_is_not_read_in_a_loop(redis: Redis, settings: Settings,
                                                                           monkeypatch) -> None:
    """A dead letter retried under its id was announced before: its waiter's future is done while
    the status says queued. It re-reads every re-check interval, never in a tight loop."""
    adm, status_reads = admission(redis, settings), statuses(redis, settings)
    m = message()
    await adm.submit(m, max_queued=100)
    done = DoneListener(redis, recheck_s=0.2)
    done._remember(m.id, None)  # the old announcement
    reads = 0
    status = status_reads.status

    async def counted(*a):
        nonlocal reads
        reads += 1
        return await status(*a)

    monkeypatch.setattr(status_reads, "status", counted)
    lookup = RequestLookup(status_reads, done, None, settings.result_ttl_s)
    result = await lookup.wait_final(MODEL, m.id, 1.0, fresh=True)
    assert not result.final and reads <= 8, reads
