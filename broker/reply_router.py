"""One reader of reply streams per api process: every open stream (SSE, OpenAI `stream: true`)
is followed through a few shared connections instead of one blocking XREAD each.

Followers fill `shards` one after the other (SHARD_FILL each, then the least followed); each
shard runs one `XREAD BLOCK` over its followers' reply streams, on a connection of its own, and
hands each entry to the followers of that stream. A worker writes a flush's tokens for every
stream of a model in one call: one shard holding them all answers it with one read, not one
per shard. A new follower must be in its shard's next read: it unblocks the shard's read
(`CLIENT UNBLOCK`) until the shard has taken it in, so its first token never waits out a block.

In a Redis Cluster one XREAD cannot span slots: shards are then per model (its keys share one
slot) and lazily made, each reading from the primary that serves the model's slot; a reader
whose node failed asks the cluster again where the slot is now. Where admissions wait for a
replica, readers read from one (`Readers`): what a reader shows, a failover keeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from redis.exceptions import RedisError

from sluice.broker.keys import ModelKeys
from sluice.broker.readers import Readers
from sluice.broker.reply_events import ReplyDecoder, ReplyEvent, final_status
from sluice.broker.reply_events import resume_index as resume_index

log = logging.getLogger(__name__)

Entry = tuple[str, dict[str, str]]
_PICKUP_S = 0.05  # a follower not yet taken in unblocks its shard again after this long
SHARD_FILL = 256  # followers a shard takes before the next shard is used


def _order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass(eq=False)
class _Follower:
    key: str
    after: str
    entries: asyncio.Queue[list[Entry]] = field(default_factory=asyncio.Queue)  # one list per read
    taken_in: asyncio.Event = field(default_factory=asyncio.Event)


class _Shard:
    def __init__(self, readers: Readers, slot_key: str, block_ms: int) -> None:
        self.readers = readers
        self.slot_key = slot_key  # a key of the slot it reads (a cluster's reader goes to its node)
        self.reader: Redis | None = None  # one connection, blocked in XREAD most of the time
        self.block_ms = block_ms
        self.followers: dict[str, set[_Follower]] = {}
        self.size = 0  # followers, all streams together
        self.client_id: int | None = None
        self.changed = asyncio.Event()
        self.closing = False
        self.unblocked = False  # a CLIENT UNBLOCK is on its way for the read under way
        self.unblocked_at = 0.0  # when it was sent (another after _PICKUP_S if the read goes on)

    def add(self, f: _Follower) -> None:
        self.followers.setdefault(f.key, set()).add(f)
        self.size += 1
        self.changed.set()

    def remove(self, f: _Follower) -> None:
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
            streams = {key: next(iter(fs)).after if len(fs) == 1 else min((f.after for f in fs), key=_order)
                       for key, fs in self.followers.items()}
            for fs in self.followers.values():
                for f in fs:
                    f.taken_in.set()
            try:
                if self.reader is None:
                    self.reader = await self.readers.open(self.slot_key)
                    await self.reader.initialize()  # its one connection, made now
                    self.reader.connection.register_connect_callback(self._connected)
                if self.client_id is None:
                    self.client_id = await self.reader.client_id()
                got = await self.reader.xread(streams, count=256, block=self.block_ms)
                if got and not await self.readers.visible(self.reader):  # a failover could take it back
                    log.info("the reply reader's node is a primary with replicas now: reading from a replica")
                    await self._reopen(refresh=False)
                    continue
            except Exception as err:  # noqa: BLE001 - Redis away, a cluster mid-failover: the shard lives on
                log.warning("reading reply streams failed (%s); retrying", err)
                await self._reopen()
                await asyncio.sleep(0.2)
                continue
            for key, entries in got or []:
                for f in list(self.followers.get(key, ())):
                    if _order(f.after) < _order(streams[key]):  # it joined during the read: not its rest
                        continue
                    after = _order(f.after)
                    new = [entry for entry in entries if _order(entry[0]) > after]
                    if new:  # a read's entries in one hand-over: the reader writes them at once
                        f.after = new[-1][0]
                        f.entries.put_nowait(new)

    async def _connected(self, connection: Connection) -> None:
        """The reader's connection was made again: redis-py's retry reconnects a read that
        Redis dropped (a restart, a broken link) and sends it again, silently. The new
        connection has another id, which CLIENT UNBLOCK must name (the old one is dead, or
        after a restart another client's)."""
        await connection.send_command("CLIENT", "ID", check_health=False)
        self.client_id = int(await connection.read_response())

    async def _reopen(self, refresh: bool = True) -> None:
        self.client_id = None  # a new connection has another id
        if (self.readers.cluster or self.readers.replicas) and self.reader is not None:  # its node may be gone
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


@dataclass
class LostFinal(ReplyEvent):
    """The final from the status hash: the reply stream expired before it was read to its end,
    so whatever of it the reader had not read yet is gone."""


class ReplyRouter:
    def __init__(self, redis: Redis, readers: Readers, *, shards: int = 4, block_ms: int = 5000,
                 recheck_s: float = 30.0) -> None:
        """`redis`: the process's client, for short commands; `readers`: connections of their
        own, one per shard. `recheck_s`: how often a quiet follower asks whether its request
        is final without a final on its stream (the stream expired before it was read): a
        command per open stream each time, so not often."""
        self.redis = redis
        self.readers = readers
        self.recheck_s = recheck_s
        self.block_ms = block_ms
        self.shard_count = shards
        self._shards: dict[tuple[str, int], _Shard] = {}
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        if not self.readers.cluster:  # every model's streams in one read: the shards start now
            for i in range(self.shard_count):
                self._shard("", i)

    def _shard(self, tag: str, i: int) -> _Shard:
        shard = self._shards.get((tag, i))
        if shard is None:
            shard = self._shards[(tag, i)] = _Shard(self.readers, tag or "sluice", self.block_ms)
            self._tasks.append(asyncio.create_task(shard.run(), name=f"reply-router-{tag}-{i}"))
        return shard

    def _shard_for(self, keys: ModelKeys, rid: str) -> _Shard:
        """The first shard (of the request's slot) with room (SHARD_FILL), else the least followed."""
        tag = keys.for_request(rid).tag if self.readers.cluster else ""
        shards = [self._shard(tag, 0)]
        while shards[-1].size >= SHARD_FILL and len(shards) < self.shard_count:
            shards.append(self._shard(tag, len(shards)))
        return min(shards, key=lambda s: s.size)

    async def close(self) -> None:
        for shard in self._shards.values():
            shard.closing = True
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2.0)
        for shard in self._shards.values():
            await shard.aclose()
        await self.readers.aclose()

    @property
    def following(self) -> int:
        return sum(s.size for s in self._shards.values())

    async def follow(self, model: str, rid: str, *, after: str = "0", next_index: int | dict[int, int] = 0,
                     idle_timeout_s: float | None = None) -> AsyncIterator[ReplyEvent]:
        """The request's reply events one by one (see follow_reads)."""
        async with contextlib.aclosing(self.follow_reads(model, rid, after=after, next_index=next_index,
                                                         idle_timeout_s=idle_timeout_s)) as reads:
            async for events in reads:
                for event in events:
                    yield event

    async def follow_reads(self, model: str, rid: str, *, after: str = "0", next_index: int | dict[int, int] = 0,
                           idle_timeout_s: float | None = None) -> AsyncIterator[list[ReplyEvent]]:
        """The request's reply events after entry `after` until the final, each token once
        (ReplyDecoder, from `next_index`: row 0's, or per row as `resume_index` gives it), as
        they came: one list per read of the shard (a reader sends them in one write); the final
        from the status hash when the reply stream holds nothing more (it expired); nothing more
        after `idle_timeout_s` without an entry."""
        keys = ModelKeys(model)
        decoder = ReplyDecoder()
        decoder.seen.update({0: next_index} if isinstance(next_index, int) else next_index)
        follower = _Follower(keys.reply(rid), after)
        shard = self._shard_for(keys, rid)
        shard.add(follower)
        try:
            await self._taken_in(shard, follower)
            lost = await self._lost_final(keys, rid, follower)  # final long ago: its stream is gone
            if lost is not None:
                yield [lost]
                return
            quiet_since = time.monotonic()
            while True:
                wait_s = self.recheck_s * random.uniform(0.5, 1.5)  # spread: many followers began together
                if idle_timeout_s is not None:
                    wait_s = min(wait_s, max(0.0, quiet_since + idle_timeout_s - time.monotonic()))
                try:
                    if follower.entries.empty():  # (asyncio.timeout: wait_for makes a task per entry)
                        async with asyncio.timeout(wait_s):
                            entries = await follower.entries.get()
                    else:
                        entries = follower.entries.get_nowait()
                    while not follower.entries.empty():  # reads that came meanwhile: in the same write
                        entries = entries + follower.entries.get_nowait()
                except TimeoutError:
                    try:
                        final = await self._lost_final(keys, rid, follower)
                    except RedisError as err:  # Redis away or busy: the shard's read goes on; check later
                        log.debug("rechecking %s failed (%s)", rid, err)
                        final = None
                    if final is not None:
                        yield [final]
                        return
                    if idle_timeout_s is not None and time.monotonic() - quiet_since >= idle_timeout_s:
                        return
                    continue
                quiet_since = time.monotonic()
                events = []
                for entry_id, fields in entries:
                    event = decoder.event(entry_id, fields)
                    if event is not None:
                        events.append(event)
                        if event.final is not None:
                            break
                if events:
                    yield events
                    if events[-1].final is not None:
                        return
        finally:
            shard.remove(follower)

    async def _taken_in(self, shard: _Shard, follower: _Follower) -> None:
        """Wait until the shard's read includes the follower, unblocking the read under way:
        one CLIENT UNBLOCK per read for all the followers that arrive meanwhile (many streams
        opening at once must not become as many commands), again after _PICKUP_S if the
        unblock came before the read blocked: once per shard, however many followers wait."""
        while not follower.taken_in.is_set():
            now = time.monotonic()
            if shard.client_id is not None and (not shard.unblocked or now - shard.unblocked_at > _PICKUP_S):
                shard.unblocked, shard.unblocked_at = True, now  # one for every follower waiting
                if shard.reader is not None:
                    await self.readers.unblock(shard.reader, shard.client_id)
            try:
                await asyncio.wait_for(follower.taken_in.wait(), _PICKUP_S)
            except TimeoutError:
                pass

    async def _lost_final(self, keys: ModelKeys, rid: str, follower: _Follower) -> ReplyEvent | None:
        """The final from the status hash, when the reply stream holds nothing after the
        follower's position although the request is final (the stream expired)."""
        final = await final_status(self.redis, keys.status(rid))
        if final is None or not follower.entries.empty():
            return None
        if await self.redis.xread({follower.key: follower.after}, count=1):
            return None  # entries still to come through the shard
        return LostFinal(follower.after, "final", final=final)
