"""The worker side of a stream: one stable consumer that fetches, guards, leases and commits.

Its helpers are objects it makes and hands what they need: the fair-share reads of new entries
(fair_share.py), prefix placement (affinity.py), the dead-letter writer (dead_letters.py) and the
inference log (broker/inference_log.py). Its worker sets how it reads through `configure`."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from sluice.broker.delivery import consumer_names
from sluice.broker.delivery.affinity import Placement, PlacementRules
from sluice.broker.delivery.calls import Commit, Lease, Settle, Start
from sluice.broker.delivery.dead_letters import DeadLetterWriter
from sluice.broker.delivery.deliveries import Delivery, Read, StartDecision, entries_read
from sluice.broker.delivery.fair_share import FairShareReads, SlotReserves, actual_cost
from sluice.broker.delivery.lanes import lanes_by_slot
from sluice.broker.delivery.quarantine import Quarantine, group_cap, history
from sluice.broker.inference_log import InferenceLog
from sluice.broker.keys import GROUP, ModelKeys
from sluice.broker.limits import ConsumerLimits
from sluice.broker.plumbing import Scripts, copied
from sluice.protocol.ids import request_shard
from sluice.protocol.messages import FinalResult, RequestMessage

log = logging.getLogger(__name__)

LEASED_PER_CALL = 500  # entry ids per lease.lua call


class StreamConsumer:
    def __init__(self, redis: Redis, model: str, consumer: str, limits: ConsumerLimits, *,
                 scripts: Scripts | None = None) -> None:
        """`scripts`: how it runs the Lua scripts (by default its own, pipelined: the calls of
        one turn of the event loop share a round trip)."""
        self.redis, self.limits, self.keys, self.consumer = redis, limits, ModelKeys(model), consumer
        self.scripts = Scripts(redis, pipelined=True) if scripts is None else scripts
        self.shards = limits.shards  # interactive streams read (a sharded model's; more while old ones drain)
        self._blocked = 0  # the interactive stream the next blocking read waits on (they take turns)
        self._token = uuid.uuid4().hex
        self.held: dict[tuple[str, str], Delivery] = {}
        self.quarantine = Quarantine()  # suspects held until the engine is empty
        # prefix affinity: off until configured
        self.affinity = Placement(self.scripts, redis, lanes=self.streams[:-1])
        self.reads = FairShareReads(redis, self.scripts, self.affinity, self.held, bulk=self.keys.bulk)
        self.dead_letters = DeadLetterWriter(redis, self.scripts, self.keys, limits)
        self.inference_log = InferenceLog(redis, self.keys.log, limits.log_max_len,
                                          limits.log_max_record_bytes)
        self.reclaimed = 0  # a running total, for the worker's metrics
        # Own pending entries are re-read once after a (re)start, following a cursor.
        self._pending_cursor: dict[str, str] = {s: "0" for s in self.streams}
        # Entries idle past the lease: looked for at every read while some are found, else this often.
        self.reclaim_scan_s = min(limits.lease_timeout_s / 4, 1.0)
        self._quiet_until: dict[str, float] = {}

    def configure(self, *, shards: int | None = None, reserves: SlotReserves | None = None,
                  placement: PlacementRules | None = None) -> None:
        """How it reads, as its worker's deployment and batching policy say (a part not given
        stays): the interactive `shards` it reads, the slots its reads keep free, and whether
        and how it places by prefix."""
        if shards is not None:
            self.shards = shards
            self.affinity.lanes = self.streams[:-1]
        if reserves is not None:
            self.reads.reserves = reserves
        if placement is not None:
            self.affinity.rules = placement

    @property
    def dead_lettered(self) -> int:
        """A running total, for the worker's metrics."""
        return self.dead_letters.written

    async def claim_name(self, ttl_s: float) -> str:
        """Take the consumer name, or the first free `<name>-<k>` if a live worker holds it. A
        restarted worker gets its old name back (and its pending entries); two never share one."""
        self.consumer = await consumer_names.claim(self.redis, self.keys, self.consumer, self._token, ttl_s)
        return self.consumer

    async def refresh_name(self, ttl_s: float) -> None:
        await consumer_names.refresh(self.redis, self.keys, self.consumer, self._token, ttl_s)

    async def release_name(self) -> None:
        await consumer_names.release(self.redis, self.keys, self.consumer, self._token)

    @property
    def streams(self) -> list[str]:
        """Interactive first (every shard's): bulk rows are taken only with capacity to spare."""
        return [k.requests for k in self.keys.shards(self.shards)] + [self.keys.bulk]

    async def ensure_groups(self) -> None:
        """Create the consumer group on each stream (and the stream) unless it exists."""
        for stream in self.streams:
            try:
                await self.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except ResponseError as err:
                if "BUSYGROUP" not in str(err):  # the group exists already: fine
                    raise

    async def fetch(self, count: int, block_ms: int, *, quarantine_room: int = 1) -> list[Delivery]:
        """At most `count` entries: own pending ones (after a restart), then those whose lease
        lapsed elsewhere (suspects wait for a quarantine group of at most `quarantine_room`: see
        Quarantine.sort), then new ones, held (and leased by lease_held()) until released. A lost
        consumer group (Redis lost its data, or was flushed) is created again; the read answers nothing."""
        try:
            return await self._fetch(count, block_ms, quarantine_room)
        except ResponseError as err:
            if "NOGROUP" not in str(err):
                raise
            log.warning("the consumer group of %s is gone (Redis lost its data): re-creating it",
                        self.keys.model)
            await self.ensure_groups()
            return []

    async def _fetch(self, count: int, block_ms: int, quarantine_room: int) -> list[Delivery]:
        room = count - len(self.quarantine.parked)
        out = self._hold(await self._redelivered(room) if room > 0 else [])
        handed = self.quarantine.sort(out, count, quarantine_room)
        if handed is not None:
            return handed
        # Interactive first, then bulk, without blocking; then block on the interactive lane
        # alone (one stream: COUNT bounds the whole read, so nothing is taken that cannot start;
        # a bulk row arriving meanwhile waits at most block_ms). Each read first moves the
        # tenants' staged requests onto the lane in fair order (FairShareReads).
        for stream in self.streams:
            n = self.reads.room(stream, count)
            if n <= 0:
                continue
            entries = await self.reads.dispatch(self.consumer, stream, n)
            if entries:
                return self._hold(await self._deliveries(stream, entries, redelivered=False))
        # Shards are slots of their own (no read spans them): the blocking read takes turns, each
        # its part of block_ms.
        self._blocked = (self._blocked + 1) % self.shards
        stream = self.keys.at(self._blocked).requests
        block = block_ms if self.shards == 1 else max(block_ms // self.shards, 10)
        entries = await self.reads.blocking_read(self.consumer, stream, count, block)
        return self._hold(await self._deliveries(stream, entries, redelivered=False))

    def _hold(self, deliveries: list[Delivery]) -> list[Delivery]:
        self.held.update((d.key, d) for d in deliveries)
        return deliveries

    def release(self, d: Delivery) -> None:
        """The entry is committed, skipped or fenced: no longer this worker's to lease."""
        self.held.pop(d.key, None)

    async def _redelivered(self, count: int) -> list[Delivery]:
        """Own pending entries left by a previous run of this worker (read once after a start,
        following a cursor), then entries idle past the lease timeout anywhere (XAUTOCLAIM).
        Runs before every read of new entries (a stream whose last scan found none is skipped
        for `reclaim_scan_s`): a dead worker's requests are taken over as fast as quarantine
        slots free up, not at a fixed rate."""
        out: list[Delivery] = []
        for stream, cursor in list(self._pending_cursor.items()):
            if len(out) >= count:
                return out
            entries = entries_read(await self.redis.xreadgroup(GROUP, self.consumer, {stream: cursor},
                                                               count=count - len(out)))
            if not entries:
                del self._pending_cursor[stream]
                continue
            self._pending_cursor[stream] = entries[-1][0]  # idle since before the restart: leased afresh
            await self.redis.xclaim(stream, GROUP, self.consumer, 0, [e for e, _ in entries], justid=True)
            out.extend(await self._deliveries(stream, entries, redelivered=True))
        min_idle = int(self.limits.lease_timeout_s * 1000)
        now = time.monotonic()
        for stream in self.streams:
            # An empty scan rests reclaim_scan_s (a lease lapses in seconds, not between reads); one
            # that found some goes on at every read: a dead worker's requests go as fast as slots free.
            if now < self._quiet_until.get(stream, 0.0):
                continue
            cursor, found = "0-0", 0
            while len(out) < count:
                cursor, entries, *_deleted = await self.redis.xautoclaim(
                    stream, GROUP, self.consumer, min_idle, start_id=cursor, count=count - len(out)
                )
                if entries:
                    found += len(entries)
                    self.reclaimed += len(entries)
                    log.warning("reclaimed %d request(s) from %s whose lease expired", len(entries), stream)
                out.extend(await self._deliveries(stream, entries, redelivered=True))
                if cursor == "0-0":
                    break
            if not found and len(out) < count:
                self._quiet_until[stream] = now + self.reclaim_scan_s
        return out

    async def dead_letter(self, stream: str, entry_id: str, rid: str, data: str, error: str, attempts: int,
                          message: RequestMessage | None = None) -> bool:
        """Move the entry to the dead-letter stream (DeadLetterWriter.write)."""
        return await self.dead_letters.write(self.consumer, stream, entry_id, rid, data, error, attempts,
                                             message)

    async def _deliveries(self, stream: str, entries: Sequence[Read], *, redelivered: bool) -> list[Delivery]:
        out = []
        for entry_id, fields in entries:
            if not fields:  # deleted after delivery: nothing to run
                await self.redis.xack(stream, GROUP, entry_id)
                continue
            if (stream, entry_id) in self.held:  # ours already (our own lease ran late): keep it once
                continue
            try:
                message = RequestMessage.from_fields(fields)
            except (ValueError, KeyError) as err:
                await self.dead_letters.unreadable(self.consumer, stream, entry_id, fields, err)
                continue
            attempt, charges, last = 1, 0, 0
            if redelivered:
                status = self.keys.status(message.id)
                attempt, charges, last = await history(self.redis, stream, GROUP, entry_id, status)
            if redelivered and charges >= self.limits.max_deliveries - 1:
                error = (f"no result after {attempt} deliveries: the worker running it stopped or crashed "
                         f"each time, {charges + 1} of them in a quarantine group of one")
                await self.dead_letter(stream, entry_id, message.id, message.model_dump_json(), error,
                                       attempt, message)
                continue
            out.append(Delivery(stream, entry_id, message, self.consumer, attempt, group_cap(last)))
        return out

    async def start(self, d: Delivery) -> StartDecision:
        """Guard the entry and, where it runs, take a fresh fencing token (kept on `d`): every
        write of this run carries it, and any later start fences them out."""
        rid = d.message.id
        decision = await self.scripts(Start(
            stream=d.stream, status=self.keys.status(rid), cancel=self.keys.cancel(rid),
            reply=self.keys.reply(rid), group=GROUP, consumer=self.consumer, entry_id=d.entry_id,
            now=time.time(), deadline=d.message.deadline, attempt=d.attempt,
            status_ttl=self.limits.status_ttl_s, reply_ttl=self.limits.reply_ttl_s,
            done_channel=self.keys.for_request(rid).done, rid=rid,
            quarantined=int(d.quarantined and d.group == 1), result_ttl=self.limits.result_ttl_s,
            nonce=uuid.uuid4().hex[:16]))
        if isinstance(decision, list):  # ['run', fencing token]
            decision, d.fence = decision
        if decision == "run" and d.quarantined:  # the group its members' next crash halves
            await self.redis.hset(self.keys.status(rid), "group", d.group)
        return decision

    async def lease_held(self) -> list[Delivery]:
        """Refresh the lease of every held entry, waiting or running; returns those this
        consumer is fenced from (another took them over; they are released)."""
        by_stream: dict[str, list[str]] = {}
        for stream, entry_id in list(self.held):
            by_stream.setdefault(stream, []).append(entry_id)
        fenced: list[Delivery] = []
        for stream, ids in by_stream.items():
            for i in range(0, len(ids), LEASED_PER_CALL):
                lost = await self.scripts(Lease(stream=stream, group=GROUP, consumer=self.consumer,
                                                entry_ids=tuple(ids[i:i + LEASED_PER_CALL])))
                for entry_id in lost:
                    d = self.held.pop((stream, entry_id), None)
                    if d is not None:
                        self.quarantine.drop(d)
                        fenced.append(d)
        return fenced

    async def commit(self, d: Delivery, result: FinalResult, streamed: list[int] | None = None,
                     deltas: list[str] | tuple = ()) -> bool | list[int]:
        """Last deltas + final + status + XACK + XDEL at once; False if fenced, [row, index, ...]
        if refused."""
        rid = d.message.id
        written = await self.scripts(Commit(
            stream=d.stream, status=self.keys.status(rid), reply=self.keys.reply(rid), group=GROUP,
            consumer=self.consumer, entry_id=d.entry_id, state=result.status.value,
            final=result.model_dump_json(exclude_none=True), now=time.time(),
            result_ttl=self.limits.result_ttl_s, reply_ttl=self.limits.reply_ttl_s,
            done_channel=self.keys.for_request(rid).done, rid=rid, rows=d.rows,
            counts=tuple(streamed or ()), fence=d.fence, deltas=tuple(deltas)))
        if isinstance(written, list):
            return written
        self.release(d)
        if written == 1 and result.usage is not None:  # its tenant's counter: what it really cost
            await self.scripts(Settle(status=self.keys.status(rid), actual=actual_cost(result.usage),
                                      stream=d.stream))
        if written and self.limits.wait_replicas:  # before the worker counts it done: on the replicas too
            await copied(self.redis, d.stream, self.limits.wait_replicas, f"the final of request {rid}")
        if not written:
            log.warning("request %s: entry %s was reclaimed by another worker; result dropped", rid,
                        d.entry_id)
        elif written == 2:
            log.info("request %s was final already (cancelled or expired meanwhile): acknowledged", rid)
        return written == 1

    async def append_log(self, records: list[dict[str, Any]]) -> None:
        """The inference log, in batched order; capped in records (approximate MAXLEN) and bytes each."""
        await self.inference_log.append(records)

    async def prune_consumers(self) -> list[str]:
        """Remove dead workers' consumers holding nothing (consumer_names.prune)."""
        lanes = lanes_by_slot(self.keys, self.shards)
        return await consumer_names.prune(self.redis, self.scripts, self.keys, lanes)

    async def cancelled(self, rids: list[str]) -> set[str]:
        """Which of these requests have their cancel flag set: one MGET per shard (one slot each)."""
        by_shard: dict[int, list[str]] = {}
        for rid in rids:
            by_shard.setdefault(request_shard(rid), []).append(rid)
        out: set[str] = set()
        for group in by_shard.values():
            flags = await self.redis.mget([self.keys.cancel(r) for r in group])
            out.update(r for r, f in zip(group, flags) if f is not None)
        return out
