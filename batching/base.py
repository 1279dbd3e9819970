"""The small interface every batching policy implements."""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, Generic, Protocol, TypeVar

log = logging.getLogger(__name__)


class Item(Protocol):
    """Something to run: a request of one or more rows (never split).

    A `quarantined` item (a suspect: a request whose retry crashed too) runs in quarantine:
    quarantined items come from the source as one group, and a policy runs one group at a time,
    never two groups together (dynamic and single: a batch of its own, alone in the engine;
    continuous: beside fresh requests). The source halves a group at each crash and charges a
    request only for a crash in a group of one."""

    @property
    def rows(self) -> int: ...

    @property
    def quarantined(self) -> bool: ...


T = TypeVar("T", bound=Item)


class Source(Protocol[T]):
    async def fetch(self, count: int, timeout_s: float, quarantine_room: int) -> list[T]:
        """Up to `count` items, waiting at most `timeout_s` for the first one: either ordinary
        ones, or (`quarantine_room` > 0: the caller runs no quarantine group now) a quarantine group
        of at most `quarantine_room` quarantined ones."""
        ...


# runs one batch to completion; a coroutine, as the policy runs each batch as a task of its own
Handler = Callable[[list[T]], Coroutine[Any, Any, None]]


class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class BatchingPolicy(abc.ABC, Generic[T]):
    """Pulls items from a source and hands them to a handler in batches.

    `run` returns once `stopping` is set, without waiting for batches still running;
    `drain` waits for those.
    """

    def __init__(self) -> None:
        self._running: set[asyncio.Task[None]] = set()
        self._freed = asyncio.Event()

    @property
    def in_flight(self) -> int:
        return len(self._running)

    @property
    @abc.abstractmethod
    def capacity(self) -> int: ...

    @abc.abstractmethod
    async def run(self, source: Source[T], handle: Handler[T], stopping: asyncio.Event) -> None: ...

    def _launch(self, handle: Handler[T], batch: list[T]) -> asyncio.Task[None]:
        return self._track(handle(batch))

    def _track(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run `work` as a batch task: counted in flight, waited for by drain()."""
        task = asyncio.create_task(work)
        self._running.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        self._freed.set()
        if not task.cancelled() and task.exception() is not None:
            log.error("a batch handler failed", exc_info=task.exception())

    async def _wait_freed_or(self, stopping: asyncio.Event) -> None:
        self._freed.clear()
        if stopping.is_set():
            return
        waiters = [asyncio.ensure_future(self._freed.wait()), asyncio.ensure_future(stopping.wait())]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()

    async def drain(self, timeout_s: float | None) -> int:
        """Wait up to `timeout_s` (None: as long as it takes) for running batches;
        returns how many are still running."""
        if self._running:
            await asyncio.wait(set(self._running), timeout=timeout_s)
        return len(self._running)
