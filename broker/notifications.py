"""Wake long-polling readers when a request's final result lands (pub/sub on sluice:done).

One subscription per api process fans the announcements out to waiting requests, so a
long poll costs nothing while tokens stream. A lost announcement (a reconnect) costs at
most one re-check interval: waiters re-read the status at least every `recheck_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import Iterator

from redis.asyncio import Redis

from sluice.broker.keys import DONE_CHANNEL

log = logging.getLogger(__name__)


class DoneListener:
    def __init__(self, redis: Redis, recheck_s: float = 1.0):
        self.redis = redis
        self.recheck_s = recheck_s
        self._waiters: dict[str, set[asyncio.Future]] = defaultdict(set)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="done-listener")

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    @contextlib.contextmanager
    def watch(self, rid: str) -> Iterator[asyncio.Future]:
        """A future set when `rid` is announced done. Watch before reading the status,
        so that an announcement between the read and the wait is not missed."""
        fut = asyncio.get_running_loop().create_future()
        self._waiters[rid].add(fut)
        try:
            yield fut
        finally:
            waiters = self._waiters.get(rid)
            if waiters is not None:
                waiters.discard(fut)
                if not waiters:
                    del self._waiters[rid]

    async def wait(self, fut: asyncio.Future, timeout_s: float) -> None:
        """Return when announced, or after min(timeout_s, recheck_s) to re-read the status."""
        await asyncio.wait([fut], timeout=min(timeout_s, self.recheck_s))

    async def _run(self) -> None:
        while True:
            try:
                async with self.redis.pubsub(ignore_subscribe_messages=True) as pubsub:
                    await pubsub.subscribe(DONE_CHANNEL)
                    async for message in pubsub.listen():
                        for fut in self._waiters.get(message["data"], ()):
                            if not fut.done():
                                fut.set_result(None)
            except asyncio.CancelledError:
                raise
            except Exception as err:
                log.warning("done-listener lost its subscription (%s); resubscribing", err)
                await asyncio.sleep(0.5)
