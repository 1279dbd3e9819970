"""The finals listener as a bulk job's runner uses it: many requests watched at once, each
announcement taken once, a forgotten request no longer reported, and a close that returns."""

from __future__ import annotations

import asyncio
import time

from redis.asyncio import Redis

from sluice.broker.keys import ModelKeys
from sluice.broker.replies.notifications import DoneListener

CHANNEL = ModelKeys("m").done


async def announce_until(redis: Redis, rid: str, seen: asyncio.Future | None = None) -> None:
    # The subscription starts in the background: announce until it is heard.
    for _ in range(200):
        await redis.spublish(CHANNEL, rid)
        if seen is not None and seen.done():
            return
        await asyncio.sleep(0.01)


async def test_an_inbox_reports_announced_requests_once_and_forgets_on_request(redis: Redis) -> None:
    done = DoneListener(redis, recheck_s=5.0)
    done.start()
    inbox = done.inbox()
    try:
        inbox.watch("m", ["a", "b", "c"])
        inbox.forget("c")
        for rid in ("a", "b", "c", "zzz"):
            await redis.spublish(CHANNEL, rid)
        await redis.spublish(ModelKeys("other").done, "a")  # another model's channel: not watched
        deadline = time.monotonic() + 5
        taken: set[str] = set()
        while taken != {"a", "b"}:
            assert time.monotonic() < deadline, taken
            await inbox.wait(0.05)
            taken |= inbox.take()
            if not taken:  # subscribed late: announce again
                for rid in ("a", "b", "c"):
                    await redis.spublish(CHANNEL, rid)
        await asyncio.sleep(0.05)
        assert "c" not in inbox.take()  # forgotten, and unknown ids are never reported
    finally:
        inbox.close()
        started = time.monotonic()
        await done.close()
        assert time.monotonic() - started < 2.0


async def test_wait_returns_after_the_recheck_interval_without_announcements(redis: Redis) -> None:
    done = DoneListener(redis, recheck_s=0.05)
    done.start()
    inbox = done.inbox()
    inbox.watch("m", ["never"])
    started = time.monotonic()
    await inbox.wait(10.0)
    assert 0.04 <= time.monotonic() - started < 1.0 and inbox.take() == set()
    inbox.close()
    await done.close()


async def test_a_single_watch_still_wakes_its_waiter(redis: Redis) -> None:
    done = DoneListener(redis, recheck_s=5.0)
    done.start()
    try:
        with done.watch("m", "r") as fut:
            await announce_until(redis, "r", fut)
            await asyncio.wait_for(fut, 2)
        assert "r" not in done._waiters  # nothing left behind
    finally:
        await done.close()


async def test_a_listener_closed_at_once_after_start_returns(redis: Redis) -> None:
    done = DoneListener(redis)
    done.start()
    await asyncio.wait_for(done.close(), 3)
