"""The shared reads of reply streams (broker/replies/router.py follows them): each shard runs one
`XREAD BLOCK` over its followers' streams on a connection of its own and hands each entry to
the followers of that stream, each from its own position.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from redis.exceptions import RedisError

from sluice.broker.plumbing import Readers, streams_read

log = logging.getLogger(__name__)

Entry = tuple[str, dict[str, str]]
PICKUP_S = 0.05  # a follower not yet taken in unblocks its shard again after this long
SHARD_FILL = 256  # followers a shard takes before the next shard is used


def order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass(eq=False)
class Follower:
    """One reader of one stream. The shard hands it each read's entries (`hand`); its reader
    waits on a future of its own, woken by a hand-over or by one timer for its next recheck,
    made once per quiet spell, not once per wait (a queue and a timeout per token cost the api
    more than the token's own work)."""

    key: str
    after: str
    reads: list[list[Entry]] = field(default_factory=list)  # handed over, not yet taken
    taken_in: asyncio.Event = field(default_factory=asyncio.Event)
    waiter: asyncio.Future[None] | None = None
    timer: asyncio.TimerHandle | None = None

    def hand(self, entries: list[Entry]) -> None:
        self.reads.append(entries)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def take(self) -> list[Entry]:
        """Every entry handed over since the last take: what came together goes in one write."""
        reads, self.reads = self.reads, []
        return reads[0] if len(reads) == 1 else [entry for read in reads for entry in read]

    def woken(self, loop: asyncio.AbstractEventLoop, at: float) -> asyncio.Future[None]:
        """A future done at the next hand-over, or at loop time `at` at the latest (its one
        timer, kept while it is due no later)."""
        self.waiter = loop.create_future()
        if self.timer is None or self.timer.when() > at:
            if self.timer is not None:
                self.timer.cancel()
            self.timer = loop.call_at(at, self._ring)
        return self.waiter

    def _ring(self) -> None:
        self.timer = None
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()


class Shard:
    def __init__(self, readers: Readers, slot_key: str, block_ms: int) -> None:
        self.readers = readers
        self.slot_key = slot_key  # a key of the slot it reads (a cluster's reader goes to its node)
        self.reader: Redis | None = None  # one connection, blocked in XREAD most of the time
        self.block_ms = block_ms
        self.followers: dict[str, set[Follower]] = {}
        self.size = 0  # followers, all streams together
        self.client_id: int | None = None
        self.changed = asyncio.Event()
        self.closing = False
        self.unblocked = False  # a CLIENT UNBLOCK is on its way for the read under way
        self.unblocked_at = 0.0  # when it was sent (another after PICKUP_S if the read goes on)

    def add(self, f: Follower) -> None:
        self.followers.setdefault(f.key, set()).add(f)
        self.size += 1
        self.changed.set()

    def remove(self, f: Follower) -> None:
        fs = self.followers.get(f.key)
        if fs is not None and f in fs:
            fs.remove(f)
            self.size -= 1
            if not fs:
                del self.followers[f.key]

    async def run(self) -> None:
        while not self.closing:
            if not self.followers:
                self.changed.clear()
                await self.changed.wait()
                continue
            self.changed.clear()
            self.unblocked = False
            # One position per stream: the earliest of its followers. Each follower keeps its own
            # cursor: a read hands it only entries after the last one it got, and only from a read
            # that began at or before that position (one that joined while a read from a later
            # position was under way waits for the next read, which starts from its own).
            streams = {key: next(iter(fs)).after if len(fs) == 1 else min((f.after for f in fs), key=order)
                       for key, fs in self.followers.items()}
            for fs in self.followers.values():
                for f in fs:
                    f.taken_in.set()
            try:
                if self.reader is None:
                    self.reader = await self.readers.open(self.slot_key)
                    await self.reader.initialize()  # its one connection, made now
                    connection = self.reader.connection
                    assert connection is not None  # (a client of a single connection: made by initialize)
                    connection.register_connect_callback(self._connected)
                if self.client_id is None:
                    self.client_id = await self.reader.client_id()
                # (redis-py types XREAD's streams as a dict of its key and id unions: a dict is
                # invariant, so no dict[str, str] passes, though that is what it sends)
                got = streams_read(await self.reader.xread(streams,  # type: ignore[arg-type]
                                                           count=256, block=self.block_ms))
                if got and not await self.readers.visible(self.reader):  # a failover could take it back
                    log.info("the reply reader's node is a primary with replicas now: reading from a replica")
                    await self._reopen(refresh=False)
                    continue
            except Exception as err:  # noqa: BLE001 - Redis away, a cluster mid-failover: the shard lives on
                log.warning("reading reply streams failed (%s); retrying", err)
                await self._reopen()
                await asyncio.sleep(0.2)
                continue
            for key, entries in got:
                read_from = streams[key]
                for f in list(self.followers.get(key, ())):
                    if f.after == read_from:  # (most often: the whole read is its next entries)
                        new = entries
                    elif order(f.after) < order(read_from):  # it joined during the read: not its rest
                        continue
                    else:
                        after = order(f.after)
                        new = [entry for entry in entries if order(entry[0]) > after]
                    if new:  # a read's entries in one hand-over: the reader writes them at once
                        f.after = new[-1][0]
                        f.hand(new)

    async def _connected(self, connection: Connection) -> None:
        """The reader's connection was made again: redis-py's retry reconnects a read that
        Redis dropped (a restart, a broken link) and sends it again, silently. The new
        connection has another id, which CLIENT UNBLOCK must name (the old one is dead, or
        after a restart another client's)."""
        await connection.send_command("CLIENT", "ID", check_health=False)
        self.client_id = int(await connection.read_response())

    async def _reopen(self, refresh: bool = True) -> None:
        self.client_id = None  # a new connection has another id
        # its node may be gone
        if (self.readers.cluster or self.readers.replicas) and self.reader is not None:
            reader, self.reader = self.reader, None
            await reader.aclose()
            try:
                if refresh:  # ask the cluster again where the slot is
                    await self.readers.refresh()
            except RedisError as err:
                log.debug("refreshing the cluster's slots failed (%s)", err)

    async def aclose(self) -> None:
        if self.reader is not None:
            await self.reader.aclose()
