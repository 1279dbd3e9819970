"""The worker side of a stream: one stable consumer that fetches, guards, leases and commits."""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Literal

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from sluice.broker.keys import DONE_CHANNEL, GROUP, ModelKeys
from sluice.broker.messages import FinalResult, RequestMessage
from sluice.broker.scripts import Scripts

log = logging.getLogger(__name__)

StartDecision = Literal["run", "final", "cancelled", "expired", "fenced"]


@dataclass
class Delivery:
    """One fetched stream entry."""

    stream: str
    entry_id: str
    message: RequestMessage
    attempt: int = 1

    @property
    def rows(self) -> int:
        return len(self.message.rows)


class StreamConsumer:
    def __init__(
        self,
        redis: Redis,
        model: str,
        consumer: str,
        *,
        status_ttl_s: int,
        reply_ttl_s: int,
        log_max_len: int,
        lease_timeout_s: float = 30.0,
        max_deliveries: int = 3,
    ):
        self.redis = redis
        self.keys = ModelKeys(model)
        self.consumer = consumer
        self.scripts = Scripts.register(redis)
        self.status_ttl_s = status_ttl_s
        self.reply_ttl_s = reply_ttl_s
        self.log_max_len = log_max_len
        self.lease_timeout_s = lease_timeout_s
        self.max_deliveries = max_deliveries
        self._token = uuid.uuid4().hex
        self._next_reclaim = 0.0
        self.reclaimed = 0  # running totals, for the worker's metrics
        self.dead_lettered = 0
        # Own pending entries are re-read once after a (re)start, following a cursor.
        self._pending_cursor: dict[str, str] = {s: "0" for s in self.streams}

    async def claim_name(self, ttl_s: float) -> str:
        """Take the consumer name, or the first free `<name>-<k>` if a live worker holds it.

        A restarted worker gets its old name back (and with it its pending entries);
        two live workers never share one.
        """
        base = self.consumer
        for k in range(1000):
            name = base if k == 0 else f"{base}-{k}"
            if await self.redis.set(self.keys.consumer_lock(name), self._token, nx=True, px=int(ttl_s * 1000)):
                self.consumer = name
                return name
        raise RuntimeError(f"no free consumer name for {base!r}")

    async def refresh_name(self, ttl_s: float) -> None:
        key = self.keys.consumer_lock(self.consumer)
        holder = await self.redis.get(key)
        if holder not in (None, self._token):
            log.error("consumer name %s is held by another worker", self.consumer)
            return
        await self.redis.set(key, self._token, px=int(ttl_s * 1000))

    async def release_name(self) -> None:
        key = self.keys.consumer_lock(self.consumer)
        if await self.redis.get(key) == self._token:
            await self.redis.delete(key)

    @property
    def streams(self) -> list[str]:
        """Interactive first: bulk rows are taken only with capacity to spare."""
        return [self.keys.requests, self.keys.bulk]

    async def ensure_groups(self) -> None:
        """Create the consumer group on each stream; a group that exists already is fine."""
        for stream in self.streams:
            try:
                await self.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except ResponseError as err:
                if "BUSYGROUP" not in str(err):
                    raise

    async def fetch(self, count: int, block_ms: int) -> list[Delivery]:
        """Own pending entries first (after a restart), then new ones, at most `count`."""
        if count <= 0:
            return []
        out: list[Delivery] = []
        for stream, cursor in list(self._pending_cursor.items()):
            if len(out) >= count:
                return out
            pending = await self.redis.xreadgroup(
                GROUP, self.consumer, {stream: cursor}, count=count - len(out)
            )
            entries = pending[0][1] if pending else []
            if entries:
                self._pending_cursor[stream] = entries[-1][0]
            else:
                del self._pending_cursor[stream]
            out.extend(await self._deliveries(stream, entries, redelivered=True))
        if out:
            return out
        out = await self._reclaim(count)
        if out:
            return out
        # Interactive first, then bulk, without blocking; then block on the interactive lane
        # alone (one stream: COUNT bounds the whole read, so nothing is taken that cannot start;
        # a bulk row arriving meanwhile waits at most block_ms).
        for stream in self.streams:
            got = await self.redis.xreadgroup(GROUP, self.consumer, {stream: ">"}, count=count)
            if got:
                return await self._deliveries(stream, got[0][1], redelivered=False)
        got = await self.redis.xreadgroup(
            GROUP, self.consumer, {self.keys.requests: ">"}, count=count, block=block_ms
        )
        return await self._deliveries(self.keys.requests, got[0][1], redelivered=False) if got else []

    async def _reclaim(self, count: int) -> list[Delivery]:
        """Take over entries idle past the lease timeout (their worker stopped renewing):
        XAUTOCLAIM, following the cursor, at most `count`, every half lease timeout."""
        now = time.monotonic()
        if now < self._next_reclaim:
            return []
        self._next_reclaim = now + self.lease_timeout_s / 2
        min_idle = int(self.lease_timeout_s * 1000)
        out: list[Delivery] = []
        for stream in self.streams:
            cursor = "0-0"
            while len(out) < count:
                cursor, entries, *_deleted = await self.redis.xautoclaim(
                    stream, GROUP, self.consumer, min_idle, start_id=cursor, count=count - len(out)
                )
                if entries:
                    self.reclaimed += len(entries)
                    log.warning("reclaimed %d request(s) from %s whose lease expired", len(entries), stream)
                out.extend(await self._deliveries(stream, entries, redelivered=True))
                if cursor == "0-0":
                    break
        return out

    async def dead_letter(self, d: Delivery, error: str) -> bool:
        rid = d.message.id
        return bool(await self.scripts.dead_letter(
            keys=[d.stream, self.keys.dead_letters, self.keys.status(rid), self.keys.reply(rid)],
            args=[GROUP, self.consumer, d.entry_id, rid, d.message.model_dump_json(), error, d.attempt,
                  time.time(), self.status_ttl_s, self.reply_ttl_s, DONE_CHANNEL],
        ))

    async def _deliveries(self, stream: str, entries: list, *, redelivered: bool) -> list[Delivery]:
        out = []
        for entry_id, fields in entries:
            if not fields:  # deleted after delivery: nothing to run
                await self.redis.xack(stream, GROUP, entry_id)
                continue
            try:
                message = RequestMessage.from_fields(fields)
            except (ValueError, KeyError) as err:
                log.error("dropping malformed entry %s on %s: %s", entry_id, stream, err)
                await self.redis.xack(stream, GROUP, entry_id)
                await self.redis.xdel(stream, entry_id)
                continue
            attempt = 1
            if redelivered:
                info = await self.redis.xpending_range(stream, GROUP, entry_id, entry_id, 1)
                attempt = int(info[0]["times_delivered"]) if info else 1
            d = Delivery(stream, entry_id, message, attempt)
            if attempt > self.max_deliveries:
                error = (f"no result after {attempt - 1} deliveries: the worker running it "
                         f"stopped or crashed each time")
                if await self.dead_letter(d, error):
                    self.dead_lettered += 1
                    log.error("request %s moved to the dead-letter stream: %s", message.id, error)
                continue
            out.append(d)
        return out

    async def start(self, d: Delivery) -> StartDecision:
        rid = d.message.id
        return await self.scripts.start(
            keys=[d.stream, self.keys.status(rid), self.keys.cancel(rid), self.keys.reply(rid)],
            args=[GROUP, self.consumer, d.entry_id, time.time(), d.message.deadline, d.attempt,
                  self.status_ttl_s, self.reply_ttl_s, DONE_CHANNEL, rid],
        )

    async def lease(self, deliveries: list[Delivery]) -> list[str]:
        """Refresh the leases of running entries; returns entry ids this consumer has lost."""
        lost: list[str] = []
        by_stream: dict[str, list[str]] = {}
        for d in deliveries:
            by_stream.setdefault(d.stream, []).append(d.entry_id)
        for stream, ids in by_stream.items():
            lost.extend(await self.scripts.lease(keys=[stream], args=[GROUP, self.consumer, *ids]))
        return lost

    async def commit(self, d: Delivery, result: FinalResult) -> bool:
        """Final event + status + XACK + XDEL at once; False if fenced out (nothing written)."""
        rid = d.message.id
        written = await self.scripts.commit(
            keys=[d.stream, self.keys.status(rid), self.keys.reply(rid)],
            args=[GROUP, self.consumer, d.entry_id, result.status.value, result.model_dump_json(exclude_none=True),
                  time.time(), self.status_ttl_s, self.reply_ttl_s, DONE_CHANNEL, rid],
        )
        if not written:
            log.warning("request %s: entry %s was reclaimed by another worker; result dropped",
                        rid, d.entry_id)
        return bool(written)

    async def append_log(self, records: list[dict]) -> None:
        """The inference log, in the order rows were batched; bounded (approximate MAXLEN)."""
        if not records:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for record in records:
                pipe.xadd(self.keys.log, {"data": json.dumps(record)}, maxlen=self.log_max_len,
                          approximate=True)
            await pipe.execute()

    async def cancelled(self, rids: list[str]) -> set[str]:
        """Which of these requests have their cancel flag set."""
        if not rids:
            return set()
        flags = await self.redis.mget([self.keys.cancel(r) for r in rids])
        return {r for r, f in zip(rids, flags) if f is not None}
