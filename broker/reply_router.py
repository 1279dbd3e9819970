"""One reader of reply streams per api process: every open stream (SSE, OpenAI `stream: true`)
is followed through a few shared connections instead of one blocking XREAD each.

Followers are spread over `shards`; each shard runs one `XREAD BLOCK` over all of its
followers' reply streams at once, on a connection of its own, and hands each entry to the
followers of that stream. A new follower must be in its shard's next read: it unblocks the
shard's read (`CLIENT UNBLOCK`) until the shard has taken it in, so its first token never
waits out a block. So an api process holds `shards` reading connections however many
streams are open, and one XREAD carries a flush's tokens for every stream of a shard.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.exceptions import RedisError

from sluice.broker.keys import ModelKeys
from sluice.broker.replies import ReplyDecoder, ReplyEvent, final_status

log = logging.getLogger(__name__)

Entry = tuple[str, dict[str, str]]
_PICKUP_S = 0.05  # a follower not yet taken in unblocks its shard again after this long


def _order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass(eq=False)
class _Follower:
    key: str
    after: str
    entries: asyncio.Queue[Entry] = field(default_factory=asyncio.Queue)
    taken_in: asyncio.Event = field(default_factory=asyncio.Event)


class _Shard:
    def __init__(self, reader: Redis, block_ms: int) -> None:
        self.reader = reader  # one connection, blocked in XREAD most of the time
        self.block_ms = block_ms
        self.followers: dict[str, set[_Follower]] = {}
        self.client_id: int | None = None
        self.changed = asyncio.Event()
        self.closing = False
        self.unblocked = False  # a CLIENT UNBLOCK is on its way for the read under way

    def add(self, f: _Follower) -> None:
        self.followers.setdefault(f.key, set()).add(f)
        self.changed.set()

    def remove(self, f: _Follower) -> None:
        fs = self.followers.get(f.key)
        if fs is not None:
            fs.discard(f)
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
            # One position per stream: the earliest of its followers (each skips what it has).
            streams = {key: min((f.after for f in fs), key=_order) for key, fs in self.followers.items()}
            for fs in self.followers.values():
                for f in fs:
                    f.taken_in.set()
            try:
                if self.client_id is None:
                    self.client_id = await self.reader.client_id()
                got = await self.reader.xread(streams, count=256, block=self.block_ms)
            except RedisError as err:
                log.warning("reading reply streams failed (%s); retrying", err)
                self.client_id = None  # a new connection has another id
                await asyncio.sleep(0.2)
                continue
            for key, entries in got or []:
                for f in list(self.followers.get(key, ())):
                    for entry in entries:
                        if _order(entry[0]) > _order(f.after):
                            f.after = entry[0]
                            f.entries.put_nowait(entry)


class ReplyRouter:
    def __init__(self, redis: Redis, reader: Callable[[], Redis], *, shards: int = 4, block_ms: int = 5000,
                 recheck_s: float = 30.0) -> None:
        """`redis`: the process's client, for short commands; `reader()`: a client with one
        connection of its own, called once per shard. `recheck_s`: how often a quiet follower
        asks whether its request is final without a final on its stream (the stream expired
        before it was read): a command per open stream each time, so not often."""
        self.redis = redis
        self.recheck_s = recheck_s
        self._shards = [_Shard(reader(), block_ms) for _ in range(shards)]
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(s.run(), name=f"reply-router-{i}") for i, s in enumerate(self._shards)]

    async def close(self) -> None:
        for shard in self._shards:
            shard.closing = True
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2.0)
        for shard in self._shards:
            await shard.reader.aclose()

    @property
    def following(self) -> int:
        return sum(len(fs) for s in self._shards for fs in s.followers.values())

    async def follow(self, model: str, rid: str, *, after: str = "0", next_index: int = 0,
                     idle_timeout_s: float | None = None) -> AsyncIterator[ReplyEvent]:
        """The request's reply events after entry `after` until the final, each token once
        (ReplyDecoder); the final from the status hash when the reply stream holds nothing more (it
        expired); nothing more after `idle_timeout_s` without an entry."""
        keys = ModelKeys(model)
        decoder = ReplyDecoder(next_index)
        follower = _Follower(keys.reply(rid), after)
        shard = self._shards[zlib.crc32(rid.encode()) % len(self._shards)]
        shard.add(follower)
        try:
            await self._taken_in(shard, follower)
            lost = await self._lost_final(keys, rid, follower)  # final long ago: its stream is gone
            if lost is not None:
                yield lost
                return
            quiet_since = time.monotonic()
            while True:
                wait_s = self.recheck_s * random.uniform(0.5, 1.5)  # spread: many followers began together
                if idle_timeout_s is not None:
                    wait_s = min(wait_s, max(0.0, quiet_since + idle_timeout_s - time.monotonic()))
                try:
                    entry_id, fields = await asyncio.wait_for(follower.entries.get(), wait_s)
                except TimeoutError:
                    try:
                        final = await self._lost_final(keys, rid, follower)
                    except RedisError as err:  # Redis away or busy: the shard's read goes on; check later
                        log.debug("rechecking %s failed (%s)", rid, err)
                        final = None
                    if final is not None:
                        yield final
                        return
                    if idle_timeout_s is not None and time.monotonic() - quiet_since >= idle_timeout_s:
                        return
                    continue
                quiet_since = time.monotonic()
                event = decoder.event(entry_id, fields)
                if event is not None:
                    yield event
                    if event.final is not None:
                        return
        finally:
            shard.remove(follower)

    async def _taken_in(self, shard: _Shard, follower: _Follower) -> None:
        """Wait until the shard's read includes the follower, unblocking the read under way:
        one CLIENT UNBLOCK per read for all the followers that arrive meanwhile (many streams
        opening at once must not become as many commands), again after _PICKUP_S if the
        unblock came before the read blocked."""
        while not follower.taken_in.is_set():
            if shard.client_id is not None and not shard.unblocked:
                shard.unblocked = True
                await self.redis.client_unblock(shard.client_id)
            try:
                await asyncio.wait_for(follower.taken_in.wait(), _PICKUP_S)
            except TimeoutError:
                shard.unblocked = False

    async def _lost_final(self, keys: ModelKeys, rid: str, follower: _Follower) -> ReplyEvent | None:
        """The final from the status hash, when the reply stream holds nothing after the
        follower's position although the request is final (the stream expired)."""
        final = await final_status(self.redis, keys.status(rid))
        if final is None or not follower.entries.empty():
            return None
        if await self.redis.xread({follower.key: follower.after}, count=1):
            return None  # entries still to come through the shard
        return ReplyEvent(follower.after, "final", final=final)
