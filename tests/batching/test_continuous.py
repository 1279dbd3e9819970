"""ContinuousAdmission over the fake source: the bound, refills, fetch sizes, stopping.

The source waits on a fake clock that these tests never advance unless they say so: whatever
happens here happens without any poll timing out, which is what "at once" means.
"""

from __future__ import annotations

import asyncio

import pytest

from sluice.batching.continuous import ContinuousAdmission
from sluice.config.batching import ContinuousBatchingConfig
from tests.fakes import WAIT_S, FakeClock, FakeSource, RecordingHandler, Req, eventually, settle, start, stop


def policy(capacity: int, poll_s: float = 30.0) -> ContinuousAdmission[Req]:
    # A long poll on a clock that does not move: nothing below can be waiting for a poll timeout.
    return ContinuousAdmission(ContinuousBatchingConfig(max_concurrent_batch_size=capacity), poll_s=poll_s)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


async def test_never_more_than_capacity_and_every_item_runs_alone(clock: FakeClock) -> None:
    p = policy(3)
    src, h = FakeSource(clock, items=10, policy=p), RecordingHandler()
    stopping, task = await start(p, src, h)
    await eventually(lambda: len(h.running) == 3, what="three running")
    await settle()
    assert len(h.running) == 3 and p.in_flight == 3
    assert src.asked == [3]  # full: no fetch while no slot is free

    while len(h.finished) < 10:
        await eventually(lambda: h.running, what="something running")
        h.release()
        await settle()
        assert len(h.running) <= 3 and p.in_flight <= 3
    assert h.max_running == 3
    assert all(len(b) == 1 for b in h.batches)
    assert sorted(b[0].n for b in h.batches) == list(range(10))
    await stop(p, src, stopping, task, h)


async def test_a_freed_slot_is_refilled_at_once(clock: FakeClock) -> None:
    p = policy(3)
    src, h = FakeSource(clock, items=6, policy=p), RecordingHandler()
    stopping, task = await start(p, src, h)
    await eventually(lambda: len(h.running) == 3, what="three running")
    first = set(h.running)

    done = h.release()
    await eventually(lambda: len(h.running) == 3 and done not in h.running, what="the freed slot refilled")
    assert clock.t == 0.0  # refilled without any poll timing out (the clock never moved)
    assert set(h.running) - first == {3}
    assert src.asked == [3, 1]
    await stop(p, src, stopping, task, h)


async def test_fetch_asks_for_exactly_the_free_slots(clock: FakeClock) -> None:
    p = policy(4)
    src, h = FakeSource(clock, items=2, policy=p), RecordingHandler()
    stopping, task = await start(p, src, h)
    await eventually(lambda: len(h.running) == 2, what="two running")
    await eventually(lambda: len(src.calls) == 2, what="the next fetch")  # waiting for more
    assert (src.calls[0].count, src.calls[0].free) == (4, 4)
    assert (src.calls[1].count, src.calls[1].free) == (2, 2)
    assert all(c.timeout_s == 30.0 for c in src.calls)  # the poll is the fetch's timeout

    src.add(5)  # two of them fit; the rest wait for slots
    await eventually(lambda: len(h.running) == 4, what="four running")
    await settle()
    assert len(h.running) == 4
    for n in sorted(h.running)[:2]:  # two slots freed together
        h.release(n)
    await eventually(lambda: len(h.running) == 4 and len(h.finished) == 2, what="refilled again")
    await h.release_all()
    await eventually(lambda: len(h.batches) == 7, what="all seven started")
    assert all(c.count == c.free and c.count > 0 for c in src.calls), src.calls
    assert clock.t == 0.0
    await stop(p, src, stopping, task, h)


async def test_a_failing_handler_frees_its_slot(clock: FakeClock) -> None:
    p = policy(1)
    src, h = FakeSource(clock, items=3, policy=p), RecordingHandler()
    h.fail = {0}
    stopping, task = await start(p, src, h)
    await eventually(lambda: 0 in h.running, what="the first request")
    h.release(0)
    await eventually(lambda: 1 in h.running, what="the next request after a failure")
    assert clock.t == 0.0  # at once, not after a poll
    assert not task.done()
    await stop(p, src, stopping, task, h)


async def test_run_returns_promptly_when_stopping_while_full(clock: FakeClock) -> None:
    p = policy(2)
    src, h = FakeSource(clock, items=5, policy=p), RecordingHandler()
    stopping, task = await start(p, src, h)
    await eventually(lambda: len(h.running) == 2, what="two running")
    stopping.set()
    # Without waiting for the running requests: they are held until released below.
    await asyncio.wait_for(task, WAIT_S)
    assert len(h.running) == 2 and p.in_flight == 2
    assert await p.drain(0) == 2  # drain reports what is still running
    await h.release_all()
    assert await p.drain(WAIT_S) == 0
    assert len(h.batches) == 2  # nothing new started after stopping
    assert src.asked == [2]


async def test_run_returns_within_its_poll_when_stopping_while_idle(clock: FakeClock) -> None:
    p = policy(2, poll_s=0.2)
    src, h = FakeSource(clock, policy=p), RecordingHandler()
    stopping, task = await start(p, src, h)
    await eventually(lambda: src.calls, what="a fetch")
    stopping.set()
    await clock.advance(0.2)  # the waiting fetch's poll ends: no later than that, run returns
    await asyncio.wait_for(task, WAIT_S)
    assert clock.t == 0.2
    assert h.batches == []
    assert src.asked == [2]  # and it did not fetch again


async def test_run_does_not_fetch_once_stopping_is_set(clock: FakeClock) -> None:
    p = policy(2)
    src, h, stopping = FakeSource(clock, items=5, policy=p), RecordingHandler(), asyncio.Event()
    stopping.set()
    await asyncio.wait_for(p.run(src, h, stopping), WAIT_S)
    assert src.calls == [] and h.batches == []


@pytest.mark.parametrize("capacity", [1, 5])
async def test_capacity_is_the_config_value(capacity: int) -> None:
    assert policy(capacity).capacity == capacity
    assert policy(capacity).in_flight == 0
