"""Dynamic and single batching with a fake clock: triggers, limit, FIFO, no split, one batch at a time."""

from __future__ import annotations

import pytest

from sluice.batching.single import SingleBatcher
from tests.fakes import FakeClock, FakeSource, RecordingHandler, Req, dynamic_batcher, settle, start, stop


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


async def test_target_releases_a_batch_without_waiting(clock: FakeClock) -> None:
    source, handler = FakeSource(clock), RecordingHandler(auto=True)
    policy = dynamic_batcher(clock, delay_ms=10_000)
    stopping, task = await start(policy, source, handler)
    source.push(*(Req(i) for i in range(4)))
    await settle()
    assert handler.sizes == [[0, 1, 2, 3]]
    assert clock.t == 0.0
    await stop(policy, source, stopping, task, handler)


async def test_delay_releases_a_lone_request_no_sooner(clock: FakeClock) -> None:
    source, handler = FakeSource(clock), RecordingHandler(auto=True)
    policy = dynamic_batcher(clock, delay_ms=200)
    stopping, task = await start(policy, source, handler)
    source.push(Req(0))
    await settle()
    await clock.advance(0.199)
    assert handler.batches == []
    await clock.advance(0.001)
    assert handler.sizes == [[0]]
    await stop(policy, source, stopping, task, handler)


async def test_fifo_batches_of_target(clock: FakeClock) -> None:
    source, handler = FakeSource(clock), RecordingHandler(auto=True)
    policy = dynamic_batcher(clock, delay_ms=60_000)
    stopping, task = await start(policy, source, handler)
    source.push(*(Req(i) for i in range(12)))
    for _ in range(5):
        await settle()
    assert handler.sizes == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    await stop(policy, source, stopping, task, handler)


async def test_next_batch_only_after_the_current_one_is_done(clock: FakeClock) -> None:
    source, handler = FakeSource(clock), RecordingHandler()
    policy = dynamic_batcher(clock, delay_ms=10)
    stopping, task = await start(policy, source, handler)
    source.push(*(Req(i) for i in range(8)))
    await settle()
    await clock.advance(1.0)
    assert handler.sizes == [[0, 1, 2, 3]]  # the second batch is ready but waits
    assert handler.max_running == 1
    await handler.release_all()
    assert handler.sizes == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert handler.max_running == 1
    await stop(policy, source, stopping, task, handler)


async def test_limit_caps_rows_and_fetch_asks_only_for_room(clock: FakeClock) -> None:
    source, handler = FakeSource(clock), RecordingHandler()
    policy = dynamic_batcher(clock, delay_ms=10, target=2, limit=3)
    stopping, task = await start(policy, source, handler)
    source.push(*(Req(i) for i in range(7)))
    await settle()
    assert handler.sizes == [[0, 1, 2]]  # past the target: up to the limit, not beyond
    await handler.release_all()
    assert handler.sizes[1] == [3, 4, 5]
    await handler.release_all()
    await clock.advance(1.0)  # the last one alone, after the delay
    assert handler.sizes[2] == [6]
    assert all(sum(r.rows for r in b) <= 3 for b in handler.batches)
    assert all(0 < n <= 3 for n in source.asked)
    await stop(policy, source, stopping, task, handler)


async def test_multi_row_request_is_never_split(clock: FakeClock) -> None:
    source, handler = FakeSource(clock), RecordingHandler(auto=True)
    policy = dynamic_batcher(clock, delay_ms=50, target=4, limit=4)
    stopping, task = await start(policy, source, handler)
    source.push(Req(0, rows=3), Req(1, rows=2), Req(2, rows=2))
    await settle()
    await clock.advance(0.05)
    await clock.advance(0.05)
    assert handler.sizes[0] == [0]  # 3 + 2 > 4: request 1 waits for the next batch
    assert handler.sizes[1] == [1, 2]
    for b in handler.batches:
        assert sum(r.rows for r in b) <= 4
    await stop(policy, source, stopping, task, handler)


async def test_stop_runs_what_was_fetched(clock: FakeClock) -> None:
    source, handler = FakeSource(clock), RecordingHandler(auto=True)
    policy = dynamic_batcher(clock, delay_ms=60_000)
    stopping, task = await start(policy, source, handler)
    source.push(Req(0), Req(1))
    await settle()
    assert handler.batches == []
    await stop(policy, source, stopping, task, handler)  # and drained: nothing left running
    assert handler.sizes == [[0, 1]]
    assert clock.t == 0.0  # run at the stop, not after the 60 s delay


async def test_single_mode_one_request_at_a_time(clock: FakeClock) -> None:
    source, handler = FakeSource(clock), RecordingHandler()
    policy = SingleBatcher(clock=clock, poll_s=10.0)
    stopping, task = await start(policy, source, handler)
    source.push(*(Req(i) for i in range(3)))
    await settle()
    assert handler.sizes == [[0]]
    await handler.release_all()
    assert handler.sizes == [[0], [1]]
    await handler.release_all()
    assert handler.sizes == [[0], [1], [2]]
    assert handler.max_running == 1
    assert all(n == 1 for n in source.asked)
    await stop(policy, source, stopping, task, handler)
