"""Wake long-polling readers when a request's final result lands: sharded pub/sub
(SSUBSCRIBE) on each model's `done` channel, which the scripts that write a final SPUBLISH to.

One subscriber per process (an api process, a bulk job's runner) fans the announcements out
to waiters, so a long poll costs nothing while tokens stream. A model's channel is subscribed
when a request of it is first watched. In a cluster, the channel lives on the node of the
model's slot (redis-py's cluster pubsub holds a connection per node and follows a failover);
classic pub/sub would be broadcast to every node. A lost announcement (a reconnect) costs at
most one re-check interval: waiters re-read the status at least every `recheck_s`.

The listener remembers the last `_RECENT` announcements, so a request watched only after its
final was announced (one just admitted, done before its submitter started to wait) is found at
once: its submitter need not read the status first (`live`). An announcement carries the final
itself when it is small (`rid` newline final, at most 4 KiB): the watch's future holds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Iterator

from redis.asyncio import Redis

from sluice.broker.keys import ModelKeys

log = logging.getLogger(__name__)

_READ_S = 0.5  # longest wait for one announcement: bounds how long close() takes
_POLL_S = 0.005  # on a cluster: how often the nodes' subscriptions are read
_RECENT, _RECENT_BYTES = 10_000, 4 << 20  # announcements remembered: at most so many, finals included
Waiter = Callable[[str, str | None], None]  # called with a request announced done, and its final if carried


class DoneListener:
    def __init__(self, redis: Redis, recheck_s: float = 1.0):
        self.redis = redis
        self.recheck_s = recheck_s
        self._waiters: dict[str, set[Waiter]] = defaultdict(set)
        self._channels: set[str] = set()  # every model channel watched so far (models are few)
        self._live: set[str] = set()  # the channels subscribed on the current connection
        self._recent: OrderedDict[str, str | None] = OrderedDict()  # the latest announcements (their finals)
        self._recent_bytes = 0
        self._new_channel = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closing = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="done-listener")

    async def close(self) -> None:
        # A flag as well as the cancel: redis-py can swallow a cancel that lands while it
        # connects or subscribes, and the task would listen on; the flag ends it within one read.
        self._closing = True
        if self._task:
            self._task.cancel()
            await asyncio.wait([self._task], timeout=2 * _READ_S)

    @contextlib.contextmanager
    def watch(self, model: str, rid: str, *, recent: bool = False) -> Iterator[asyncio.Future]:
        """A future set when `rid` is announced done, to the final's JSON when the announcement
        carried it (else None). Watch before reading the status, so that an announcement between
        the read and the wait is not missed. `recent`: an announcement heard before the watch
        counts too (only for a request just admitted: a dead letter retried under the same id
        was announced before, with its old final)."""
        fut = asyncio.get_running_loop().create_future()

        def announced(_: str, final: str | None) -> None:
            if not fut.done():
                fut.set_result(final)

        self._add(model, rid, announced)
        if recent and rid in self._recent:
            announced(rid, self._recent[rid])
        try:
            yield fut
        finally:
            self._discard(rid, announced)

    def live(self, model: str, rid: str) -> bool:
        """Whether an announcement of `rid` would reach this listener now (its channel is
        subscribed): then a watch set up after the announcement still finds it (it is recent)."""
        return ModelKeys(model).for_request(rid).done in self._live

    def inbox(self) -> Inbox:
        """A changing set of watched requests (a bulk job's outstanding lines), and which of
        them were announced done since the last look."""
        return Inbox(self)

    def _add(self, model: str, rid: str, waiter: Waiter) -> None:
        self._waiters[rid].add(waiter)
        channel = ModelKeys(model).for_request(rid).done  # the shard of the request
        if channel not in self._channels:
            self._channels.add(channel)
            self._new_channel.set()

    def _discard(self, rid: str, waiter: Waiter) -> None:
        waiters = self._waiters.get(rid)
        if waiters is not None:
            waiters.discard(waiter)
            if not waiters:
                del self._waiters[rid]

    async def wait(self, fut: asyncio.Future, timeout_s: float) -> None:
        """Return when announced, or after min(timeout_s, recheck_s) to re-read the status."""
        await asyncio.wait([fut], timeout=min(timeout_s, self.recheck_s))

    def _remember(self, rid: str, final: str | None) -> None:
        self._recent_bytes += len(final or "") - len(self._recent.pop(rid, None) or "")
        self._recent[rid] = final
        while len(self._recent) > _RECENT or self._recent_bytes > _RECENT_BYTES:
            self._recent_bytes -= len(self._recent.popitem(last=False)[1] or "")

    async def _run(self) -> None:
        while not self._closing:
            try:
                async with self.redis.pubsub(ignore_subscribe_messages=True) as pubsub:
                    # A single server's pubsub is one connection: a read waits on it. A cluster's
                    # holds one per node and reads them in turn, each for the whole timeout: a
                    # message on one node waited out the others' (0.5 s each). So each is asked
                    # without waiting, every _POLL_S.
                    cluster = hasattr(pubsub, "get_sharded_message")
                    read = pubsub.get_sharded_message if cluster else pubsub.get_message
                    subscribed = self._live = set()
                    while not self._closing:
                        if self._new_channel.is_set() or not subscribed:
                            self._new_channel.clear()
                            for channel in sorted(self._channels - subscribed):
                                await pubsub.ssubscribe(channel)
                                subscribed.add(channel)
                        if not subscribed:
                            with contextlib.suppress(TimeoutError):
                                await asyncio.wait_for(self._new_channel.wait(), _READ_S)
                            continue
                        message = await read(ignore_subscribe_messages=True,
                                             timeout=0.0 if cluster else _READ_S)
                        if message is None and cluster:
                            await asyncio.sleep(_POLL_S)
                        if message is None or message.get("type") != "smessage":
                            continue
                        rid, _, final = message["data"].partition("\n")
                        self._remember(rid, final or None)
                        for waiter in list(self._waiters.get(rid, ())):
                            waiter(rid, final or None)
            except asyncio.CancelledError:
                raise
            except Exception as err:
                self._live = set()
                log.warning("done-listener lost its subscription (%s); resubscribing", err)
                await asyncio.sleep(0.5)


class Inbox:
    """Watches many requests at once. Watch a request before reading its status (as with
    `DoneListener.watch`), so that an announcement between the read and the wait is kept."""

    def __init__(self, listener: DoneListener):
        self._listener = listener
        self._watched: set[str] = set()
        self._announced: set[str] = set()
        self._event = asyncio.Event()

    def watch(self, model: str, rids: Iterable[str]) -> None:
        for rid in rids:
            if rid not in self._watched:
                self._watched.add(rid)
                self._listener._add(model, rid, self._on_done)

    def forget(self, rid: str) -> None:
        self._watched.discard(rid)
        self._announced.discard(rid)
        self._listener._discard(rid, self._on_done)

    def close(self) -> None:
        for rid in list(self._watched):
            self.forget(rid)

    def take(self) -> set[str]:
        """The watched requests announced done since the last take."""
        out, self._announced = self._announced, set()
        self._event.clear()
        return out

    async def wait(self, timeout_s: float) -> None:
        """Return once an announcement is waiting to be taken, or after min(timeout_s,
        recheck_s) for the caller to re-read what it watches."""
        if not self._announced:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._event.wait(), min(timeout_s, self._listener.recheck_s))

    def _on_done(self, rid: str, _: str | None) -> None:
        self._announced.add(rid)
        self._event.set()
