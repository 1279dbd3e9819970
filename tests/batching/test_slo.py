"""The TPOT governor: on an engine whose time per output token grows with concurrency, the
admitted concurrency settles where the target holds, comes back up when there is room, and
never moves on too few samples; ContinuousAdmission keeps to the limit it sets."""

from __future__ import annotations

import pytest

from sluice.batching.continuous import ContinuousAdmission
from sluice.batching.slo import ConcurrencyGovernor
from sluice.config.batching import ContinuousBatchingConfig
from tests.fakes import FakeClock, FakeSource, RecordingHandler, eventually, settle, start, stop


def engine_tpot(concurrency: int) -> float:
    """A CPU engine past its knee: 20 ms per token alone, 5 ms more per request beside it."""
    return 0.020 + 0.005 * (concurrency - 1)


def saturated(governor: ConcurrencyGovernor, windows: int, tpot=engine_tpot) -> list[int]:
    limits = []
    for _ in range(windows):
        for _ in range(governor.window):
            governor.observe(tpot(governor.limit), governor.limit)
        limits.append(governor.limit)
    return limits


def test_the_limit_settles_where_the_target_holds() -> None:
    g = ConcurrencyGovernor(target_tpot_s=0.060, capacity=256)
    limits = saturated(g, 12)
    assert engine_tpot(limits[-1]) <= 0.060  # on target...
    assert engine_tpot(limits[-1] + 2) > 0.060 or limits[-1] >= 8  # ...and not far below it
    assert 6 <= limits[-1] <= 9
    assert limits[0] == 128  # at most halved in one step
    assert len(set(limits[-4:])) <= 2  # steady, not swinging


def test_the_limit_comes_back_up_when_the_engine_gets_faster() -> None:
    g = ConcurrencyGovernor(target_tpot_s=0.060, capacity=64)
    saturated(g, 12)
    low = g.limit
    limits = saturated(g, 20, tpot=lambda c: 0.5 * engine_tpot(c))  # e.g. shorter prompts now
    assert limits[-1] > low and 0.5 * engine_tpot(limits[-1]) <= 0.060


def test_an_idle_worker_does_not_raise_its_limit_and_few_samples_change_nothing() -> None:
    g = ConcurrencyGovernor(target_tpot_s=0.060, capacity=64, start=8)
    for _ in range(7):
        assert g.observe(0.5, 8) == 8  # far over target, but fewer than a window
    assert g.observe(0.5, 8) < 8
    low = g.limit
    for _ in range(3 * g.window):
        g.observe(0.001, 1)  # fast, but the limit was never reached: no evidence there is room
    assert g.limit == low


@pytest.mark.parametrize("capacity", [1, 4])
def test_the_limit_stays_within_one_and_capacity(capacity: int) -> None:
    g = ConcurrencyGovernor(target_tpot_s=0.001, capacity=capacity)
    assert saturated(g, 10)[-1] == 1
    g = ConcurrencyGovernor(target_tpot_s=10.0, capacity=capacity, start=1)
    assert saturated(g, 40)[-1] == capacity


async def test_continuous_admission_keeps_to_the_limit() -> None:
    clock = FakeClock()
    p: ContinuousAdmission = ContinuousAdmission(ContinuousBatchingConfig(max_concurrent_batch_size=8), poll_s=30.0)
    p.limit = 2
    src, h = FakeSource(clock, items=6, policy=p), RecordingHandler()
    stopping, task = await start(p, src, h)
    await eventually(lambda: len(h.running) == 2, what="two running")
    await settle()
    assert len(h.running) == 2 and src.asked == [2] and p.admitted == 2
    p.limit = 3  # raised: the next freed slot refills two
    h.release()
    await eventually(lambda: len(h.running) == 3, what="three running")
    while len(h.finished) < 6:
        await eventually(lambda: h.running, what="something running")
        h.release()
        await settle()
    assert h.max_running == 3
    await stop(p, src, stopping, task, h)
