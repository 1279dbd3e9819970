"""A fake clock and an in-memory source for the batching policies."""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass


class FakeClock:
    instances: weakref.WeakSet[FakeClock]

    def __init__(self) -> None:
        FakeClock.instances.add(self)
        self.t = 0.0
        self._sleepers: list[tuple[float, asyncio.Future]] = []

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._sleepers.append((self.t + seconds, fut))
        try:
            if seconds <= 0:
                fut.set_result(None)
            await fut
        finally:
            self._sleepers = [(t, f) for t, f in self._sleepers if f is not fut]

    async def advance(self, seconds: float) -> None:
        self.t += seconds
        for due, fut in list(self._sleepers):
            if due <= self.t and not fut.done():
                fut.set_result(None)
        await settle()


FakeClock.instances = weakref.WeakSet()


async def settle(rounds: int = 50) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


@dataclass(frozen=True)
class Req:
    n: int
    rows: int = 1
    isolated: bool = False


def take_items(items: list[Req], count: int, isolated: int) -> tuple[list[Req], list[Req]]:
    """The FIFO prefix a source may hand out: at most `count` items and `isolated` isolated
    ones (an isolated item that may not go yet stops the prefix: nothing overtakes it)."""
    got: list[Req] = []
    for item in items[:count]:
        if item.isolated:
            if isolated <= 0:
                break
            isolated -= 1
        got.append(item)
    return got, items[len(got):]


class FakeSource:
    """Items pushed by the test; fetch returns what is there or waits for the (fake) timeout."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.items: list[Req] = []
        self.asked: list[int] = []
        self._pushed = asyncio.Event()

    def push(self, *items: Req) -> None:
        self.items.extend(items)
        self._pushed.set()

    async def fetch(self, count: int, timeout_s: float, isolated: int = 1) -> list[Req]:
        self.asked.append(count)
        if not take_items(self.items, count, isolated)[0]:  # nothing it may hand out: wait, as Redis would
            self._pushed.clear()
            waits = [asyncio.ensure_future(self._pushed.wait()), asyncio.ensure_future(self.clock.sleep(timeout_s))]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
        got, self.items = take_items(self.items, count, isolated)
        return got


class RecordingHandler:
    """Records batches; each batch runs until the test releases it (or at once with auto)."""

    def __init__(self, auto: bool = False) -> None:
        self.batches: list[list[Req]] = []
        self.auto = auto
        self.running = 0
        self.max_running = 0
        self._release = asyncio.Event()

    async def __call__(self, batch: list[Req]) -> None:
        self.batches.append(batch)
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            if not self.auto:
                self._release.clear()
                await self._release.wait()
        finally:
            self.running -= 1

    async def release(self) -> None:
        self._release.set()
        await settle()

    @property
    def sizes(self) -> list[list[int]]:
        return [[r.n for r in b] for b in self.batches]
