"""ContinuousAdmission over an in-memory source: the bound, refills, fetch sizes, stopping."""

from __future__ import annotations

import asyncio
import time

import pytest

from sluice.batching.continuous import ContinuousAdmission
from sluice.config.batching import ContinuousBatchingConfig
from tests.fakes import Req, take_items


class MemorySource:
    """Items pushed by the test. Records each fetch with the policy's free slots at that moment."""

    def __init__(self, policy: ContinuousAdmission, items: int = 0) -> None:
        self.policy = policy
        self.items = [Req(i) for i in range(items)]
        self.calls: list[tuple[int, int, float]] = []  # (count asked, free slots, timeout_s)
        self._pushed = asyncio.Event()

    def push(self, n: int) -> None:
        start = len(self.items) + sum(c for c, _, _ in self.calls) + 1000
        self.items.extend(Req(start + i) for i in range(n))
        self._pushed.set()

    def wake(self) -> None:
        """End a waiting fetch early, empty-handed (the 30 s poll would outlast the tests)."""
        self._pushed.set()

    async def fetch(self, count: int, timeout_s: float, isolated: int = 1) -> list[Req]:
        self.calls.append((count, self.policy.capacity - self.policy.in_flight, timeout_s))
        if not take_items(self.items, count, isolated)[0]:  # nothing it may hand out: wait, as Redis would
            self._pushed.clear()
            try:
                await asyncio.wait_for(self._pushed.wait(), timeout_s)
            except TimeoutError:
                return []
        got, self.items = take_items(self.items, count, isolated)
        return got


class Handler:
    """Each request runs until the test releases it; counts how many run at once."""

    def __init__(self) -> None:
        self.batches: list[list[Req]] = []
        self.running: dict[int, asyncio.Event] = {}
        self.peak = 0
        self.finished: list[int] = []
        self.fail: set[int] = set()

    async def __call__(self, batch: list[Req]) -> None:
        self.batches.append(batch)
        (req,) = batch
        release = asyncio.Event()
        self.running[req.n] = release
        self.peak = max(self.peak, len(self.running))
        try:
            await release.wait()
            if req.n in self.fail:
                raise RuntimeError(f"request {req.n} failed")
        finally:
            del self.running[req.n]
            self.finished.append(req.n)

    def release(self, n: int | None = None) -> int:
        n = min(self.running) if n is None else n
        self.running[n].set()
        return n

    def release_all(self) -> None:
        for ev in self.running.values():
            ev.set()


async def eventually(check, timeout_s: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.005)


async def settle(rounds: int = 20) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


def policy(capacity: int, poll_s: float = 30.0) -> ContinuousAdmission:
    # A long poll: anything that happens "at once" below cannot be waiting for a poll timeout.
    return ContinuousAdmission(ContinuousBatchingConfig(max_concurrent_batch_size=capacity), poll_s=poll_s)


async def stop(p: ContinuousAdmission, task: asyncio.Task, stopping: asyncio.Event, h: Handler,
               src: MemorySource) -> None:
    stopping.set()
    src.wake()
    await asyncio.wait_for(task, 5)
    h.release_all()
    assert await p.drain(5) == 0


async def test_never_more_than_capacity_and_every_item_runs_alone() -> None:
    p = policy(3)
    src, h, stopping = MemorySource(p, items=10), Handler(), asyncio.Event()
    task = asyncio.create_task(p.run(src, h, stopping))
    await eventually(lambda: len(h.running) == 3, what="three running")
    await settle()
    assert len(h.running) == 3 and p.in_flight == 3
    assert [c for c, _, _ in src.calls] == [3]  # full: no fetch while no slot is free

    while len(h.finished) < 10:
        await eventually(lambda: h.running, what="something running")
        h.release()
        await settle()
        assert len(h.running) <= 3 and p.in_flight <= 3
    assert h.peak == 3
    assert all(len(b) == 1 for b in h.batches)
    assert sorted(b[0].n for b in h.batches) == list(range(10))
    await stop(p, task, stopping, h, src)


async def test_a_freed_slot_is_refilled_at_once() -> None:
    p = policy(3)
    src, h, stopping = MemorySource(p, items=6), Handler(), asyncio.Event()
    task = asyncio.create_task(p.run(src, h, stopping))
    await eventually(lambda: len(h.running) == 3, what="three running")
    first = set(h.running)

    done = h.release()
    started = time.monotonic()
    await eventually(lambda: len(h.running) == 3 and done not in h.running, timeout_s=2.0,
                     what="the freed slot refilled")
    assert time.monotonic() - started < 2.0  # far below the 30 s poll
    assert set(h.running) - first == {3}
    assert [c for c, _, _ in src.calls] == [3, 1]
    await stop(p, task, stopping, h, src)


async def test_fetch_asks_for_exactly_the_free_slots() -> None:
    p = policy(4)
    src, h, stopping = MemorySource(p, items=2), Handler(), asyncio.Event()
    task = asyncio.create_task(p.run(src, h, stopping))
    await eventually(lambda: len(h.running) == 2, what="two running")
    await eventually(lambda: len(src.calls) == 2, what="the next fetch")  # waiting for more
    assert src.calls[0][:2] == (4, 4)
    assert src.calls[1][:2] == (2, 2)
    assert all(t == 30.0 for _, _, t in src.calls)  # the poll is the fetch's timeout

    src.push(5)  # two of them fit; the rest wait for slots
    await eventually(lambda: len(h.running) == 4, what="four running")
    await settle()
    assert len(h.running) == 4
    for n in sorted(h.running)[:2]:  # two slots freed together
        h.release(n)
    await eventually(lambda: len(h.running) == 4 and len(h.finished) == 2, what="refilled again")
    h.release_all()
    await eventually(lambda: len(h.batches) == 7, what="all seven started")
    assert all(count == free and count > 0 for count, free, _ in src.calls), src.calls
    await stop(p, task, stopping, h, src)


async def test_a_failing_handler_frees_its_slot() -> None:
    p = policy(1)
    src, h, stopping = MemorySource(p, items=3), Handler(), asyncio.Event()
    h.fail = {0}
    task = asyncio.create_task(p.run(src, h, stopping))
    await eventually(lambda: 0 in h.running, what="the first request")
    h.release(0)
    await eventually(lambda: 1 in h.running, timeout_s=2.0, what="the next request after a failure")
    assert not task.done()
    await stop(p, task, stopping, h, src)


async def test_run_returns_promptly_when_stopping_while_full() -> None:
    p = policy(2)
    src, h, stopping = MemorySource(p, items=5), Handler(), asyncio.Event()
    task = asyncio.create_task(p.run(src, h, stopping))
    await eventually(lambda: len(h.running) == 2, what="two running")
    stopping.set()
    await asyncio.wait_for(task, 2.0)  # without waiting for the running requests
    assert len(h.running) == 2 and p.in_flight == 2
    assert await p.drain(0.05) == 2  # drain reports what is still running
    h.release_all()
    assert await p.drain(5) == 0
    assert len(h.batches) == 2  # nothing new started after stopping
    assert [c for c, _, _ in src.calls] == [2]


async def test_run_returns_promptly_when_stopping_while_idle() -> None:
    p = policy(2, poll_s=0.2)
    src, h, stopping = MemorySource(p), Handler(), asyncio.Event()
    task = asyncio.create_task(p.run(src, h, stopping))
    await eventually(lambda: src.calls, what="a fetch")
    started = time.monotonic()
    stopping.set()
    await asyncio.wait_for(task, 5.0)
    assert time.monotonic() - started < 2.0
    assert h.batches == []


async def test_run_does_not_fetch_once_stopping_is_set() -> None:
    p = policy(2)
    src, h, stopping = MemorySource(p, items=5), Handler(), asyncio.Event()
    stopping.set()
    await asyncio.wait_for(p.run(src, h, stopping), 1.0)
    assert src.calls == [] and h.batches == []


@pytest.mark.parametrize("capacity", [1, 5])
async def test_capacity_is_the_config_value(capacity: int) -> None:
    assert policy(capacity).capacity == capacity
    assert policy(capacity).in_flight == 0
