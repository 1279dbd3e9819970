"""Isolated (redelivered) requests in every policy: a batch of their own, one at a time,
nothing overtakes them and they overtake nothing."""

from __future__ import annotations

import asyncio

import pytest

from sluice.batching.continuous import ContinuousAdmission
from sluice.config.batching import ContinuousBatchingConfig
from tests.fakes import WAIT_S, FakeClock, FakeSource, RecordingHandler, Req, dynamic_batcher, settle, start, stop


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


async def test_a_quarantined_request_is_a_dynamic_batch_of_its_own(clock: FakeClock) -> None:
    source, handler = FakeSource(clock), RecordingHandler()
    policy = dynamic_batcher(clock, delay_ms=100, target=4, limit=8)
    stopping, task = await start(policy, source, handler)
    source.push(Req(0), Req(1), Req(2, quarantined=True), Req(3))
    await settle()
    # the prefix before the quarantined request goes at once: nothing can join it
    assert handler.sizes == [[0, 1]]
    await handler.release_all()
    assert handler.sizes == [[0, 1], [2]]  # alone, at once
    await handler.release_all()
    assert handler.sizes == [[0, 1], [2]]  # what follows is an ordinary batch again: it waits
    await clock.advance(0.1)
    assert handler.sizes == [[0, 1], [2], [3]]
    await stop(policy, source, stopping, task, handler)


async def test_a_quarantine_group_is_a_dynamic_batch_of_its_own(clock: FakeClock) -> None:
    source, handler = FakeSource(clock), RecordingHandler()
    policy = dynamic_batcher(clock, delay_ms=10_000, target=2, limit=8)
    stopping, task = await start(policy, source, handler)
    source.push(Req(0, quarantined=True), Req(1, quarantined=True), Req(2), Req(3))
    await settle()
    assert handler.sizes == [[0, 1]]  # the group together, at once, nothing else with it
    await handler.release_all()
    assert handler.sizes == [[0, 1], [2, 3]]
    await stop(policy, source, stopping, task, handler)


async def test_continuous_admission_runs_one_quarantine_group_at_a_time_beside_fresh_ones() -> None:
    """A group goes beside fresh requests (the engine is not drained for it); the next group is
    asked for only once the last of the current one is done."""
    clock = FakeClock()
    source, handler = FakeSource(clock), RecordingHandler()
    policy = ContinuousAdmission(ContinuousBatchingConfig(max_concurrent_batch_size=6), poll_s=10.0)
    stopping = asyncio.Event()
    task = asyncio.create_task(policy.run(source, handler, stopping))
    source.push(Req(0))
    await settle()
    source.push(Req(1, quarantined=True), Req(2, quarantined=True), Req(3), Req(4, quarantined=True))
    await settle()
    assert [b[0].n for b in handler.batches] == [0, 1, 2, 3]  # the group beside 0, then 3
    asked = len(source.calls)
    await clock.advance(10.0)  # while the group runs, 4 (another group) may not go
    assert [b[0].n for b in handler.batches] == [0, 1, 2, 3]
    assert all(c.quarantine_room == 0 for c in source.calls[asked:])
    handler.release(1)
    await clock.advance(10.0)
    assert [b[0].n for b in handler.batches] == [0, 1, 2, 3]  # 2 of the group still runs
    handler.release(2)
    await clock.advance(10.0)
    assert [b[0].n for b in handler.batches] == [0, 1, 2, 3, 4]
    stopping.set()
    handler.auto = True
    await handler.release_all()
    await clock.advance(10.0)  # the poll of the fetch still waiting ends
    await asyncio.wait_for(task, WAIT_S)
    assert await policy.drain(WAIT_S) == 0
