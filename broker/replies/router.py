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
import math
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import RedisError

from sluice.broker.keys import ModelKeys
from sluice.broker.plumbing import Readers
from sluice.broker.replies import shards as reply_shards
from sluice.broker.replies.events import ReplyDecoder, ReplyEvent, final_status
from sluice.broker.replies.events import resume_index as resume_index
from sluice.broker.replies.shards import PICKUP_S, Follower, Shard

log = logging.getLogger(__name__)


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
        self._shards: dict[tuple[str, int], Shard] = {}
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        if not self.readers.cluster:  # every model's streams in one read: the shards start now
            for i in range(self.shard_count):
                self._shard("", i)

    def _shard(self, tag: str, i: int) -> Shard:
        shard = self._shards.get((tag, i))
        if shard is None:
            shard = self._shards[(tag, i)] = Shard(self.readers, tag or "sluice", self.block_ms)
            self._tasks.append(asyncio.create_task(shard.run(), name=f"reply-router-{tag}-{i}"))
        return shard

    def _shard_for(self, keys: ModelKeys, rid: str) -> Shard:
        """The first shard (of the request's slot) with room (SHARD_FILL), else the least followed."""
        tag = keys.for_request(rid).tag if self.readers.cluster else ""
        shards = [self._shard(tag, 0)]
        while shards[-1].size >= reply_shards.SHARD_FILL and len(shards) < self.shard_count:
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
                     idle_timeout_s: float | None = None, fresh: bool = False) -> AsyncIterator[ReplyEvent]:
        """The request's reply events one by one (see follow_reads)."""
        reads = self.follow_reads(model, rid, after=after, next_index=next_index,
                                  idle_timeout_s=idle_timeout_s, fresh=fresh)
        async with contextlib.aclosing(reads):
            async for events in reads:
                for event in events:
                    yield event

    async def follow_reads(self, model: str, rid: str, *, after: str = "0",
                           next_index: int | dict[int, int] = 0, idle_timeout_s: float | None = None,
                           fresh: bool = False) -> AsyncGenerator[list[ReplyEvent], None]:
        """The request's reply events after entry `after` until the final, each token once
        (ReplyDecoder, from `next_index`: row 0's, or per row as `resume_index` gives it), as
        they came: one list per read of the shard (a reader sends them in one write); the final
        from the status hash when the reply stream holds nothing more (it expired); nothing more
        after `idle_timeout_s` without an entry. `fresh`: the caller admitted the request just
        now, or has just read its status and it was not final, so its stream cannot have
        expired yet: no look at its status first (a Redis round trip per stream; the quiet
        recheck still looks later)."""
        keys = ModelKeys(model)
        decoder = ReplyDecoder()
        decoder.seen.update({0: next_index} if isinstance(next_index, int) else next_index)
        follower = Follower(keys.reply(rid), after)
        shard = self._shard_for(keys, rid)
        shard.add(follower)
        try:
            await self._taken_in(shard, follower)
            # a final long ago: its stream is gone
            lost = None if fresh else await self._lost_final(keys, rid, follower)
            if lost is not None:
                yield [lost]
                return
            loop = asyncio.get_running_loop()
            recheck_s = self.recheck_s * random.uniform(0.5, 1.5)  # spread: many followers began together
            active_at = checked_at = loop.time()
            while True:
                if not follower.reads:
                    now = loop.time()
                    idle_at = active_at + idle_timeout_s if idle_timeout_s is not None else math.inf
                    due = min(max(active_at, checked_at) + recheck_s, idle_at)
                    if now < due:
                        await follower.woken(loop, due)
                        continue
                    try:
                        final = await self._lost_final(keys, rid, follower)
                    except RedisError as err:  # Redis away or busy: the shard's read goes on; check later
                        log.debug("rechecking %s failed (%s)", rid, err)
                        final = None
                    if final is not None:
                        yield [final]
                        return
                    if now >= idle_at:
                        return
                    checked_at = loop.time()
                    continue
                entries = follower.take()
                active_at = loop.time()
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
            follower.stop()
            shard.remove(follower)

    async def _taken_in(self, shard: Shard, follower: Follower) -> None:
        """Wait until the shard's read includes the follower, unblocking the read under way:
        one CLIENT UNBLOCK per read for all the followers that arrive meanwhile (many streams
        opening at once must not become as many commands), again after PICKUP_S if the
        unblock came before the read blocked: once per shard, however many followers wait."""
        while not follower.taken_in.is_set():
            now = time.monotonic()
            if shard.client_id is not None and (not shard.unblocked or now - shard.unblocked_at > PICKUP_S):
                shard.unblocked, shard.unblocked_at = True, now  # one for every follower waiting
                if shard.reader is not None:
                    await self.readers.unblock(shard.reader, shard.client_id)
            try:
                await asyncio.wait_for(follower.taken_in.wait(), PICKUP_S)
            except TimeoutError:
                pass

    async def _lost_final(self, keys: ModelKeys, rid: str, follower: Follower) -> ReplyEvent | None:
        """The final from the status hash, when the reply stream holds nothing after the
        follower's position although the request is final (the stream expired)."""
        final = await final_status(self.redis, keys.status(rid))
        if final is None or follower.reads:
            return None
        if await self.redis.xread({follower.key: follower.after}, count=1):
            return None  # entries still to come through the shard
        return LostFinal(follower.after, "final", final=final)
