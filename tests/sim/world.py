"""The simulated deployment: one redis-server, an api (admission, cancels, dead letters, a reply
router), workers and readers, and the faults. `step()` runs one step: one broker call of one
actor, or one fault."""

from __future__ import annotations

import asyncio
import copy
import hashlib
import inspect
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from redis.asyncio import Redis

from sluice.broker.delivery.dead_letters import DeadLetters
from sluice.broker.intake.admission import Admission, QueueFull
from sluice.broker.intake.cancels import Cancels
from sluice.broker.intake.status_reads import StatusReads
from sluice.broker.keys import GROUP, ModelKeys
from sluice.broker.limits import AdmissionLimits
from sluice.broker.plumbing.readers import Readers
from sluice.broker.replies.router import ReplyRouter
from sluice.protocol.messages import RequestMessage, SamplingSpec, StructuredSpec
from tests.sim.actors import (
    AGED_MS,
    CANCEL_TTL_S,
    MODEL,
    REPLY_TTL_S,
    RESULT_TTL_S,
    STATUS_TTL_S,
    Lossy,
    Reader,
    Worker,
)
from tests.sim.clock import SimClock

KEYS = ModelKeys(MODEL)


class Server(Protocol):
    """The redis-server the simulation started (an EmbeddedRedis): stopped and started again."""

    def stop(self, kill: bool = False) -> None: ...
    def start(self) -> Any: ...
TENANTS = ("t0", "t1", "t2")
MAX_QUEUED = 12
WORKERS = 3
OWNER = "owner-digest"


@dataclass
class Req:
    """What the clients know of a request they sent."""

    idx: int
    message: RequestMessage
    key: str | None  # its Idempotency-Key


@dataclass
class Ledger:
    """What the invariants need to remember; restored with the data when a failover takes
    writes back (what the lost writes did is undone for the checks too)."""

    accepted: dict[str, str] = field(default_factory=dict)  # rid -> entry id of its admission
    keys: dict[str, str] = field(default_factory=dict)  # idempotency key -> rid
    finals: dict[str, dict[str, str]] = field(default_factory=dict)  # rid -> the final status seen
    expired: set[str] = field(default_factory=set)  # rids whose status the clock expired
    revived: set[str] = field(default_factory=set)  # rids a dlq retry put back (a new run is allowed)


class Violation(AssertionError):
    def __init__(self, invariant: str, detail: str) -> None:
        super().__init__(f"{invariant}: {detail}")
        self.invariant = invariant


class World(Lossy):
    def __init__(self, redis: Redis, url: str, seed: int, server: Server | None = None) -> None:
        super().__init__()
        self.redis, self.url, self.seed = redis, url, seed
        self.server = server  # the simulation's own redis-server (with its AOF): restarts take it down
        self.clock = SimClock()
        limits = AdmissionLimits(status_ttl_s=STATUS_TTL_S, reply_ttl_s=REPLY_TTL_S, cancel_ttl_s=CANCEL_TTL_S,
                                 result_ttl_s=RESULT_TTL_S)
        self.admission, self.cancels = Admission(redis, limits), Cancels(redis, limits)
        self.statuses = StatusReads(redis, limits)
        self.admission.scripts = self.wrap(self.admission.scripts)
        self.cancels.scripts = self.wrap(self.cancels.scripts)
        self.letters = DeadLetters(redis, MODEL, status_ttl_s=STATUS_TTL_S)
        self.letters.scripts = self.wrap(self.letters.scripts)
        self.router = ReplyRouter(redis, Readers(url, redis, name="sim-replies"), shards=2, block_ms=2000,
                                  recheck_s=0.5)
        self.affinity = seed % 2 == 1  # odd seeds: workers place by prefix group (docs/prefix-affinity.md)
        self.workers = [Worker(redis, f"w{i}", 0, affinity=self.affinity) for i in range(WORKERS)]
        self.requests: list[Req] = []
        self.readers: list[Reader] = []
        self.ledger = Ledger()
        self.snapshot: tuple[list[tuple[str, int, bytes]], Ledger] | None = None
        self.started_since_snapshot: set[str] = set()  # requests started after the snapshot
        self.lost_starts: set[str] = set()  # requests a failover took the start of back, still running
        self.poison: set[str] = set()  # requests that crash the worker generating them (until a dlq retry)
        self.log: list[str] = []  # what each step did (printed with a failing replay)
        self.dead: list[str] = []  # the request ids in the dead-letter stream after the last step
        self.unread = 0  # entries on the streams no worker has read yet, after the last step

    async def open(self) -> None:
        await self.redis.flushall()
        for w in self.workers:
            await w.consumer.ensure_groups()
        self.router.start()

    async def close(self) -> None:
        for r in self.readers:
            await r.hang_up()
        for w in self.workers:
            w.crash()
        await self.router.close()

    # -- the api actor
    def _message(self, idx: int, rows: int, structured: bool, bulk: bool, tenant: str) -> RequestMessage:
        digest = hashlib.sha256(f"{self.seed}:{idx}".encode()).hexdigest()[:32]
        now = self.clock.time()
        return RequestMessage(
            id=f"req-{int(self.clock.start * 1000):013d}-{digest}", model=MODEL,
            rows=[{"prompt": f"p{idx}.{r}", "max_tokens": 3 + (idx + r) % 6} for r in range(rows)],
            sampling=SamplingSpec(max_tokens=8, seed=idx,
                                  structured=StructuredSpec(regex="t.*") if structured else None),
            enqueued_at=now, deadline=now + 400 + 150 * (idx % 8), lane="bulk" if bulk else "interactive",
            owner=OWNER if bulk or rows > 1 else None,  # one call, one owner
            # tenants take turns (fair share): dispatch moves entries between the api and a worker;
            # three prefix groups, which workers place by with affinity on
            tenant=tenant, prefix=[f"{idx % 3:012x}"])

    async def admit(self, n: int, rows: int, structured: bool, bulk: bool, idem: int) -> str:
        """One native submit (`idem`: 0 no Idempotency-Key, 1 a new one, 2+ an earlier one again)
        or, with n > 1, one call of n requests (a completion's `n`, all or none)."""
        tenant = TENANTS[len(self.requests) % len(TENANTS)]  # one call, one tenant
        messages = [self._message(len(self.requests) + i, rows, structured, bulk, tenant) for i in range(n)]
        reqs = [Req(len(self.requests) + i, m, None) for i, m in enumerate(messages)]
        self.requests += reqs
        if n == 1 and idem:
            used = sorted({r.key for r in self.requests if r.key})
            key = f"k{len(used)}" if idem == 1 or not used else used[idem % len(used)]
            reqs[0].key = key
            return await self._admit_keyed(reqs[0], key)
        try:
            entries = await self.admission.submit_many(messages, max_queued=MAX_QUEUED, result_ttl_s=RESULT_TTL_S)
        except QueueFull:
            return "queue full"
        for m, entry in zip(messages, entries):
            self._accepted(m.id, entry)
        return f"admitted {[r.idx for r in reqs]}"

    async def _admit_keyed(self, req: Req, key: str) -> str:
        """api/requests.py's _submit: the key binds to an id first; a repeat whose first call left
        no status admits again under that id."""
        m = req.message
        first = await self.admission.claim_idempotency(key, m.id, MODEL)
        if first is not None:
            rid = first[1]
            if self.ledger.keys.get(key, rid) != rid:
                raise Violation("one key, one id", f"key {key} answered {rid}, first bound to {self.ledger.keys[key]}")
            self.ledger.keys[key] = rid
            if await self.statuses.status(MODEL, rid):
                return f"repeat of {rid[-6:]}"
            was_admitted = getattr(self.admission, "was_admitted", None)  # (defect 3's fix)
            if was_admitted is not None and await was_admitted(MODEL, rid):
                return f"410: {rid[-6:]} finished and its result expired"
            m = m.model_copy(update={"id": rid})
            req.message = m
        self.ledger.keys[key] = m.id
        keyed = {"keyed": True} if "keyed" in inspect.signature(self.admission.submit).parameters else {}
        try:
            entry = await self.admission.submit(m, max_queued=MAX_QUEUED, result_ttl_s=RESULT_TTL_S, **keyed)
        except QueueFull:
            await self.admission.release_idempotency(key)
            self.ledger.keys.pop(key, None)
            return "queue full"
        self._accepted(m.id, entry)
        return f"admitted {req.idx} as {m.id[-6:]} (key {key})"

    def _accepted(self, rid: str, entry: str) -> None:
        before = self.ledger.accepted.get(rid)
        if entry and before and before != entry and rid not in self.ledger.revived:
            raise Violation("one key, one run", f"request {rid} admitted again as entry {entry} (first {before}): "
                                                "a second run under one id")
        if entry or rid not in self.ledger.accepted:
            self.ledger.accepted[rid] = entry or before or ""

    async def cancel(self, req: int) -> str:
        return str(await self.cancels.cancel(MODEL, self.rid(req)))

    async def dlq(self, req: int, mode: int) -> str:
        """`sluice dlq drop` (mode 0), `retry` (1), or two operators' retries at once (2)."""
        rid = self.rid(req)
        if not mode:
            return f"dropped {await self.letters.drop([rid])}"
        before = await self._entries_of(rid)
        listed = [d.request_id for d in await self.letters.list()].count(rid)
        retries = [self.letters.retry([rid], max_queued=MAX_QUEUED) for _ in range(mode)]
        done = [rid for got in await asyncio.gather(*retries) for rid in got]
        added = await self._entries_of(rid) - before
        if added > listed:
            raise Violation("one dead letter, one entry", f"dlq retry of {rid} (listed {listed} time(s)) "
                                                          f"put {added} entries on the stream")
        if added and not done:  # (a call re-sent after its answer was lost is told its entry: 'requeued')
            raise Violation("dlq retry says what it did", f"dlq retry of {rid} put {added} entries on the stream "
                                                          "and reported the letter gone")
        if done:
            self.poison.discard(rid)  # (the operator retries once its cause is fixed)
            self.ledger.revived.add(rid)
            self.ledger.finals.pop(rid, None)
            for r in self.readers:
                if r.rid == rid:
                    r.tainted = True  # a new run under an old id: its stream starts again
        return f"retried {done}"

    async def _entries_of(self, rid: str) -> int:
        found = 0
        for stream in (KEYS.requests, KEYS.bulk):
            found += sum(1 for _, f in await self.redis.xrange(stream) if f.get("id") == rid)
        return found

    def rid(self, req: int) -> str:
        return self.requests[req % len(self.requests)].message.id

    # -- readers
    def join(self, req: int) -> str:
        reader = Reader(len(self.readers), self.rid(req))
        self.readers.append(reader)
        reader.join(self.router, self.redis)
        return f"reader {reader.idx} follows {reader.rid[-6:]}"

    async def catch_up(self, timeout_s: float = 1.0) -> None:
        """Pacing, not a check: give live readers up to `timeout_s` to read what their streams hold
        now, so that a hang-up lands mid-stream rather than before the first event arrived."""
        deadline, quiet, last = time.monotonic() + timeout_s, 0, None
        while time.monotonic() < deadline and quiet < 10:  # (a reader skips entries it holds: no progress)
            live = [r for r in self.readers if r.live]
            if not live:
                return
            now = [(r.idx, r.last_id) for r in live]
            quiet, last = (quiet + 1 if now == last else 0), now
            async with self.redis.pipeline(transaction=False) as pipe:
                for r in live:
                    pipe.xrevrange(KEYS.reply(r.rid), count=1)
                ends = await pipe.execute()
            if all(not end or _order(end[0][0]) <= _order(r.last_id) for r, end in zip(live, ends)):
                return
            await asyncio.sleep(0.002)

    async def observe(self) -> None:
        """What the scheduler weighs its next step by: the dead letters, the entries not read yet."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xrange(KEYS.dead_letters)
            for stream in (KEYS.requests, KEYS.bulk):
                pipe.xlen(stream)
                pipe.xpending(stream, GROUP)
            letters, *lanes = await pipe.execute()
        self.dead = [f.get("id", "") for _, f in letters]
        self.unread = sum(n - pending["pending"] for n, pending in zip(lanes[::2], lanes[1::2]))

    # -- faults
    async def crash(self, w: int) -> None:
        old = self.workers[w]
        old.crash()
        self.workers[w] = Worker(self.redis, old.name, old.restarts + 1, affinity=self.affinity)

    async def duplicate(self, req: int) -> str:
        r = self.requests[req % len(self.requests)]
        status = await self.statuses.status(MODEL, r.message.id)
        if status is None or status.final:
            return "nothing to duplicate"
        stream = KEYS.bulk if r.message.lane == "bulk" else KEYS.requests
        return f"entry {await self.redis.xadd(stream, r.message.to_fields())} repeats {r.idx}"

    async def restart(self) -> str:
        """Redis stopped and started again from its AOF (the default durability, appendfsync
        everysec): every acknowledged write comes back. (A kill -9 may lose the last second's
        writes under a slow disk: that loss is the failover fault's, which the checks follow.)
        The actors' connections drop; they reconnect (redis-py's retries), the scripts are
        loaded again, the reply router's blocked read is sent again."""
        if self.server is None:
            return "no server of its own"
        await asyncio.to_thread(self.server.stop)
        await asyncio.to_thread(self.server.start)
        return "restarted from its AOF"

    async def take_snapshot(self) -> None:
        dumped = []
        async for key in self.redis.scan_iter("*"):
            data = await self.redis.dump(key)
            if data is not None:
                dumped.append((key, max(await self.redis.pttl(key), 0), data))
        self.snapshot = (dumped, copy.deepcopy(self.ledger))
        self.started_since_snapshot = set()

    async def failover(self) -> str:
        """A replica that missed the writes since the snapshot takes over (asynchronous
        replication): the data and what the checks remember go back to the snapshot."""
        if self.snapshot is None:
            return "no snapshot"
        dumped, ledger = self.snapshot
        await self.redis.flushall()
        raw = self.redis.execute_command
        for key, ttl, data in dumped:
            await raw("RESTORE", key, ttl, data, "REPLACE")
        self.ledger = copy.deepcopy(ledger)
        self.lost_starts, self.started_since_snapshot = self.started_since_snapshot, set()
        ends = await self._stream_ends()
        for r in self.readers:  # it read from the primary (no replica reads here): what it showed may be gone
            shown_lost = r.last_id != "0" and (not ends[r.rid] or _order(ends[r.rid]) < _order(r.last_id))
            r.tainted = r.tainted or shown_lost or (r.final is not None and r.rid not in self.ledger.finals)
        return f"restored {len(dumped)} keys"

    async def _stream_ends(self) -> dict[str, str]:
        """Each followed request's last reply entry."""
        rids = sorted({r.rid for r in self.readers})
        async with self.redis.pipeline(transaction=False) as pipe:
            for rid in rids:
                pipe.xrevrange(KEYS.reply(rid), count=1)
            got = await pipe.execute()
        return {rid: last[0][0] if last else "" for rid, last in zip(rids, got)}

    async def advance(self, seconds: int) -> str:
        """Time passes: TTLs run down (keys past theirs expire), pending entries grow idle."""
        self.clock.elapsed += seconds
        gone = []
        async for key in self.redis.scan_iter("*"):
            ttl = await self.redis.pttl(key)
            if ttl < 0:
                continue
            if ttl <= seconds * 1000:
                await self.redis.delete(key)
                gone.append(key)
            else:
                await self.redis.pexpire(key, ttl - seconds * 1000)
        for key in gone:
            if ":status:" in key:
                self.ledger.expired.add(key.rsplit(":", 1)[1])
        await self.age_pending(seconds * 1000)
        return f"{len(gone)} keys expired"

    async def age_pending(self, add_ms: int | None = None) -> None:
        """Every pending entry idle `add_ms` longer (None: past any lease), whoever holds it."""
        for stream in (KEYS.requests, KEYS.bulk):
            for p in await self.redis.xpending_range(stream, GROUP, "-", "+", 10_000):
                idle = AGED_MS if add_ms is None else p["time_since_delivered"] + add_ms
                await self.redis.xclaim(stream, GROUP, p["consumer"], 0, [p["message_id"]], idle=idle, justid=True)

    # -- one step
    async def step(self, action: tuple[Any, ...]) -> str:
        self.clock.tick()
        name, *args = action
        w = self.workers[args[0] % len(self.workers)] if name in WORKER_STEPS else None
        if name == "admit":
            return await self.admit(*args)
        if not self.requests and name in NEEDS_REQUEST:
            return "no request"
        if name == "cancel":
            return await self.cancel(*args)
        if name == "dlq":
            return await self.dlq(*args)
        if name == "join":
            joined = self.join(args[0])
            if len(args) > 1 and args[1] >= 0:  # the reader starts while this worker's flush is under way
                await self.workers[args[1] % len(self.workers)].flush()
                return f"{joined}, joined during a flush"
            return joined
        if name in ("hangup", "reconnect"):
            if not self.readers:
                return "no reader"
            reader = self.readers[args[0] % len(self.readers)]
            if name == "hangup" and reader.live:
                await reader.hang_up()
                return f"reader {reader.idx} hung up after {reader.last_id}"
            if name == "reconnect" and reader.task is not None and not reader.live and reader.final is None:
                reader.join(self.router, self.redis)
                return f"reader {reader.idx} resumes after {reader.last_id}"
            return "nothing"
        if name == "fetch":
            if len(args) > 2 and args[2]:  # the replica a failover may promote has not seen this read
                await self.take_snapshot()
            return f"fetched {[d.message.id[-6:] + '@' + str(d.attempt) for d in await w.fetch(args[1])]}"
        if name == "start":
            before = set(w.runs)
            started = await w.start(args[1])
            if self.snapshot is not None:
                self.started_since_snapshot |= set(w.runs) - before
            if (set(w.runs) - before) & self.poison:  # it crashes the engine as it is loaded
                await self.crash(args[0] % len(self.workers))
                return f"{started}, poison: crashed"
            return str(started)
        if name == "resume":
            return str(await w.resume(self.rid(args[1])))
        if name == "emit":
            rid = self.rid(args[1])
            if rid in self.poison and w.generating(rid):  # the engine dies on it, and its batch with it
                await self.crash(args[0] % len(self.workers))
                return "poison: crashed"
            return str(await w.emit(rid, args[2], args[3]))
        if name == "flush":
            await w.flush()
            return "flushed"
        if name == "commit":
            return str(await w.commit(self.rid(args[1])))
        if name == "lease":
            return f"lost {await w.lease()}"
        if name == "watch":
            await w.watch(self.clock.time())
            return "watched"
        if name == "crash":
            await self.crash(args[0] % len(self.workers))
            return "crashed"
        if name == "freeze":
            await w.age_leases()
            return "frozen past its lease"
        if name == "lose":
            (self if args[0] < 0 else self.workers[args[0] % len(self.workers)]).lose = True
            return "next reply lost"
        if name == "dup":
            return await self.duplicate(*args)
        if name == "poison":
            self.poison.add(self.rid(args[0]))
            return "crashes its worker from now on"
        if name == "snapshot":
            await self.take_snapshot()
            return "snapshot"
        if name == "failover":
            return await self.failover()
        if name == "clock":
            return await self.advance(*args)
        if name == "restart":
            return await self.restart()
        raise ValueError(f"unknown step {action!r}")

    def wall(self) -> float:
        return time.monotonic()


def _order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


WORKER_STEPS = {"fetch", "start", "resume", "emit", "flush", "commit", "lease", "watch", "crash", "freeze"}
NEEDS_REQUEST = {"cancel", "dlq", "join", "resume", "emit", "commit", "dup", "poison"}
