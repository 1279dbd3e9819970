"""The one set of fakes for the batching policies: a fake clock, an in-memory source, a
recording handler whose batches run until the test releases them, waiting helpers, and
starting and stopping a policy over them.

Nothing here reads the wall clock to decide an outcome: time is the FakeClock's, so a test that
never advances it proves that nothing waited for a poll or a delay. Only `eventually` reads the
real clock, as a generous limit on waiting for a condition (a failure, not a measurement).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from sluice.batching.base import BatchingPolicy
from sluice.batching.dynamic import DynamicBatcher
from sluice.config.batching import DynamicBatchingConfig

# Long enough that a loaded machine never trips it; a condition that holds arrives in milliseconds.
WAIT_S = 10.0


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0
        self._sleepers: list[tuple[float, asyncio.Future[None]]] = []

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
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


async def settle(rounds: int = 50) -> None:
    """Let every task that can run without time passing run (loop turns, not seconds)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


async def eventually(check: Callable[[], object | Awaitable[object]], timeout_s: float = WAIT_S,
                     what: str = "condition", interval_s: float = 0.001) -> None:
    """Wait until `check()` is truthy (it may be a coroutine function); fail after `timeout_s`.
    Checks that ask Redis use a longer `interval_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        ok = check()
        if inspect.isawaitable(ok):
            ok = await ok
        if ok:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(interval_s)


@dataclass(frozen=True)
class Req:
    n: int
    rows: int = 1
    quarantined: bool = False


def take_items(items: list[Req], count: int, quarantine_room: int) -> tuple[list[Req], list[Req]]:
    """The FIFO prefix a source may hand out, as the broker's consumer does: at most `count`
    ordinary items up to the first quarantined one, or (the first is quarantined) a quarantine group
    of at most `quarantine_room` quarantined items, never both; a quarantined item that may not go yet stops the
    prefix: nothing overtakes it."""
    got: list[Req] = []
    group = bool(items) and items[0].quarantined
    for item in items[:min(count, quarantine_room) if group else count]:
        if item.quarantined != group:
            break
        got.append(item)
    return got, items[len(got):]


@dataclass(frozen=True)
class Fetch:
    """One call of FakeSource.fetch, as the policy made it."""

    count: int
    timeout_s: float
    quarantine_room: int
    free: int | None  # the policy's free slots at that moment (None: no policy given)


class FakeSource:
    """Items pushed by the test; fetch returns what it may hand out, or waits (as Redis would)
    until something is pushed, `wake()` is called or the (fake) timeout passes."""

    def __init__(self, clock: FakeClock, *, items: int = 0, policy: BatchingPolicy[Req] | None = None) -> None:
        self.clock = clock
        self.policy = policy
        self.items: list[Req] = []
        self.calls: list[Fetch] = []
        self._next = 0
        self._pushed = asyncio.Event()
        self.add(items)

    @property
    def asked(self) -> list[int]:
        return [c.count for c in self.calls]

    def push(self, *items: Req) -> None:
        self.items.extend(items)
        self._next = max([self._next, *(r.n + 1 for r in items)])
        self._pushed.set()

    def add(self, n: int) -> list[Req]:
        """Push n fresh single-row requests, numbered after every request pushed so far."""
        fresh = [Req(self._next + i) for i in range(n)]
        self.push(*fresh)
        return fresh

    def wake(self) -> None:
        """End a waiting fetch early, empty-handed unless something may be handed out."""
        self._pushed.set()

    async def fetch(self, count: int, timeout_s: float, quarantine_room: int = 1) -> list[Req]:
        free = self.policy.capacity - self.policy.in_flight if self.policy is not None else None
        self.calls.append(Fetch(count, timeout_s, quarantine_room, free))
        if not take_items(self.items, count, quarantine_room)[0]:  # nothing it may hand out: wait, as Redis would
            self._pushed.clear()
            waits = [asyncio.ensure_future(self._pushed.wait()), asyncio.ensure_future(self.clock.sleep(timeout_s))]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
        got, self.items = take_items(self.items, count, quarantine_room)
        return got


class RecordingHandler:
    """Records batches; each runs until the test releases it (or at once with `auto`).

    A running batch is known by its first request's `n` (for the single-row batches of
    continuous admission, the request's own). A batch whose key is in `fail` raises once released.
    """

    def __init__(self, auto: bool = False) -> None:
        self.batches: list[list[Req]] = []
        self.auto = auto
        self.running: dict[int, asyncio.Event] = {}
        self.finished: list[int] = []
        self.fail: set[int] = set()
        self.max_running = 0

    async def __call__(self, batch: list[Req]) -> None:
        self.batches.append(batch)
        key = batch[0].n
        gate = asyncio.Event()
        self.running[key] = gate
        self.max_running = max(self.max_running, len(self.running))
        try:
            if not self.auto:
                await gate.wait()
            if key in self.fail:
                raise RuntimeError(f"batch {key} failed")
        finally:
            del self.running[key]
            self.finished.append(key)

    def release(self, n: int | None = None) -> int:
        """Let one running batch finish (the lowest key unless named); returns its key."""
        n = min(self.running) if n is None else n
        self.running[n].set()
        return n

    async def release_all(self) -> None:
        """Let every batch running now finish, then let the policy react (new batches wait again)."""
        for gate in self.running.values():
            gate.set()
        await settle()

    @property
    def sizes(self) -> list[list[int]]:
        return [[r.n for r in b] for b in self.batches]


def dynamic_batcher(clock: FakeClock, delay_ms: int = 100, target: int = 4,
                    limit: int | None = None) -> DynamicBatcher[Req]:
    cfg = DynamicBatchingConfig(max_batch_delay_ms=delay_ms, batch_size_target=target, batch_size_limit=limit)
    # A 10 s poll on the fake clock: a fetch ends early only because something arrived.
    return DynamicBatcher(cfg, clock=clock, poll_s=10.0)


async def start(policy: BatchingPolicy[Req], source: FakeSource,
                handler: RecordingHandler) -> tuple[asyncio.Event, asyncio.Task[None]]:
    stopping = asyncio.Event()
    task = asyncio.create_task(policy.run(source, handler, stopping))
    await settle()
    return stopping, task


async def stop(policy: BatchingPolicy[Req], source: FakeSource, stopping: asyncio.Event,
               task: asyncio.Task[None], handler: RecordingHandler) -> None:
    """Stop the policy, then let everything it holds finish: run() returns and nothing is left
    running (what it had fetched runs too, batch after batch)."""
    stopping.set()
    handler.auto = True  # batches started by the stop itself run through
    await handler.release_all()
    source.wake()  # a fetch waiting on the clock ends, as its poll would
    await asyncio.wait_for(task, WAIT_S)
    assert await policy.drain(WAIT_S) == 0
