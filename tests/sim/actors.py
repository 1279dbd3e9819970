"""The simulation's actors: workers that drive the real consumer, reply writer and generation
code one broker call per step, and readers that follow reply streams through the api's reply
router. (The api actor's calls are in world.py: each is one Admission or DeadLetters call.)"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from redis.asyncio import Redis

from sluice.broker.delivery.affinity import PlacementRules
from sluice.broker.delivery.consumer import Delivery, StreamConsumer
from sluice.broker.keys import GROUP
from sluice.broker.limits import ConsumerLimits
from sluice.broker.plumbing import ScriptCall, Scripts
from sluice.broker.replies.router import ReplyRouter, resume_index
from sluice.broker.replies.writer import ReplyWriter, delivered, heard_cancel
from sluice.protocol.messages import FinalResult
from sluice.protocol.states import State
from sluice.workers.generation import Generation, Running, final_result
from tests.sim.engine import SimEngine

MODEL = "sim"
STATUS_TTL_S, RESULT_TTL_S, REPLY_TTL_S, CANCEL_TTL_S = 1800, 600, 60, 600
LEASE_S = 300  # a lease lapses only when the simulation ages an entry (freeze, clock)
AGED_MS = 10_000_000  # an idle time past any lease
MAX_DELIVERIES = 2  # a second takeover dead-letters: `dlq retry` has letters to work on


async def settle() -> None:
    """Let the generation tasks take what the engine handed them (no I/O on that path)."""
    for _ in range(12):
        await asyncio.sleep(0)


class Lossy:
    """`lose` makes the actor's next script call run twice, as redis-py's retry does after a
    connection dropped with the reply on its way: Redis applied the first call."""

    def __init__(self) -> None:
        self.lose = False

    def wrap(self, scripts: Scripts) -> LossyScripts:
        return LossyScripts(scripts, self)


class LossyScripts:
    """`scripts` as its actor's: a call made while the actor's `lose` is set runs twice."""

    def __init__(self, scripts: Scripts, actor: Lossy) -> None:
        self.scripts, self.actor = scripts, actor

    async def __call__(self, call: ScriptCall):
        if self.actor.lose:
            self.actor.lose = False
            await self.scripts(call)
        return await self.scripts(call)


@dataclass
class Run:
    d: Delivery
    running: Running
    task: asyncio.Task | None = None  # None until resumed (a redelivery reads its stream first)


class Worker(Lossy):
    """One worker process (`restarts`: how many times it was restarted under its name)."""

    def __init__(self, redis: Redis, name: str, restarts: int, *, affinity: bool = False) -> None:
        super().__init__()
        self.redis, self.name, self.restarts = redis, name, restarts
        self.consumer = StreamConsumer(redis, MODEL, name, ConsumerLimits(
            status_ttl_s=STATUS_TTL_S, reply_ttl_s=REPLY_TTL_S, log_max_len=1000, lease_timeout_s=LEASE_S,
            max_deliveries=MAX_DELIVERIES, result_ttl_s=RESULT_TTL_S),
            scripts=self.wrap(Scripts(redis, pipelined=True)))
        if affinity:  # placing by prefix group, every entry due at once: own groups first, any order of moves
            self.consumer.configure(placement=PlacementRules(wait_ms=0))
        # as workers/worker.py: an unfinished request's stream lives as long as its status
        self.replies = ReplyWriter(redis, MODEL, reply_ttl_s=STATUS_TTL_S)
        self._write = self.replies._write
        self.replies._write = self._lossy_write
        self.engine = SimEngine(f"{name}g{restarts}.")
        self.generation = Generation(self.engine, self.replies)
        self.fetched: list[Delivery] = []  # held, not started
        self.runs: dict[str, Run] = {}

    async def _lossy_write(self, calls):
        if self.lose:  # the flush's pipeline is applied, its reply lost, and redis-py sends it again
            self.lose = False
            await self._write(calls)
        return await self._write(calls)

    def crash(self) -> None:
        for run in self.runs.values():
            if run.task is not None:
                run.task.cancel()

    async def fetch(self, count: int) -> list[Delivery]:
        got = await self.consumer.fetch(count, 1, quarantine_room=count)
        self.fetched += got
        return got

    async def start(self, pick: int) -> str | None:
        """workers/worker.py's _start_and_run, up to the generation."""
        if not self.fetched:
            return None
        d = self.fetched.pop(pick % len(self.fetched))
        rid = d.message.id
        if rid in self.runs:  # another entry of a request running here: never run one twice
            self.consumer.release(d)
            return "running here"
        decision = await self.consumer.start(d)
        if decision != "run":
            self.consumer.release(d)
            return decision
        self.runs[rid] = run = Run(d, Running.start(d))
        if d.attempt == 1:
            await self._begin(run, {})
        return decision

    async def resume(self, rid: str) -> bool:
        run = self.runs.get(rid)
        if run is None or run.task is not None:
            return False
        await self._begin(run, await delivered(self.redis, MODEL, rid))
        return True

    async def _begin(self, run: Run, resume: dict) -> None:
        run.task = asyncio.ensure_future(self.generation.rows(run.running, resume))
        await settle()

    def generating(self, rid: str) -> bool:
        run = self.runs.get(rid)
        return run is not None and run.task is not None and not run.task.done()

    async def emit(self, rid: str, row: int, n: int) -> bool:
        run = self.runs.get(rid)
        if run is None or run.task is None or row >= len(run.running.engine_ids):
            return False
        fed = self.engine.feed(run.running.engine_ids[row], n)
        await settle()
        return fed

    async def flush(self) -> None:
        await self.replies.flush()

    async def commit(self, rid: str) -> bool | None:
        """The rest of _start_and_run: the final, committed with the deltas not flushed yet.
        None: nothing to commit (not finished; or fenced: dropped quietly)."""
        run = self.runs.get(rid)
        if run is None or run.task is None or not run.task.done():
            return None
        del self.runs[rid]
        self.consumer.release(run.d)
        error, outputs = None, []
        try:
            outputs = run.task.result()
        except asyncio.CancelledError:
            return None
        except Exception as err:  # noqa: BLE001 - as the worker: the request fails, naming why
            error = f"{type(err).__name__}: {err}"
        if run.running.fenced:
            return None
        final = final_result(run.running, outputs, error)
        return await self.replies.commit(run.d, final, self.consumer.commit)

    async def lease(self) -> list[str]:
        """workers/worker.py's _lease: runs another worker took over are aborted."""
        lost = []
        for d in await self.consumer.lease_held():
            run = self.runs.get(d.message.id)
            if run is not None and run.d.key == d.key and not run.running.fenced:
                run.running.fenced = True
                await self.generation.abort(run.running)
                lost.append(d.message.id)
        await settle()
        return lost

    async def watch(self, now: float) -> None:
        """workers/worker.py's _watch: cancel flags and deadlines abort running requests."""
        runs = {rid: r for rid, r in self.runs.items()
                if r.task is not None and not r.task.done() and r.running.stop_reason is None and not r.running.fenced}
        if not runs:
            return
        # (every answer counts as stale: the flags are read as the worker reads those it heard nothing of)
        heard, unheard = heard_cancel({rid: r.d for rid, r in runs.items()}, float("inf"))
        for rid in heard | await self.consumer.cancelled(unheard):
            runs[rid].running.stop_reason = State.CANCELLED
            await self.generation.abort(runs[rid].running)
        for r in runs.values():
            if r.running.stop_reason is None and now > r.d.message.deadline:
                r.running.stop_reason = State.EXPIRED
                await self.generation.abort(r.running)
        await settle()

    async def age_leases(self, idle_ms: int | None = None) -> None:
        """Frozen past its lease: its pending entries look idle (to XAUTOCLAIM) as long as `idle_ms`."""
        for stream in self.consumer.streams:
            pending = await self.redis.xpending_range(stream, GROUP, "-", "+", 10_000, consumername=self.name)
            ids = [p["message_id"] for p in pending]
            if ids:
                await self.redis.xclaim(stream, GROUP, self.name, 0, ids, idle=idle_ms or AGED_MS, justid=True)


@dataclass
class Reader:
    """One client following a request's reply stream, across hang-ups and resumes."""

    idx: int
    rid: str
    rows: dict[int, list[str]] = field(default_factory=dict)
    next: dict[int, int] = field(default_factory=dict)
    last_id: str = "0"
    final: FinalResult | None = None
    lost: bool = False  # told the stream expired: handed the final from the status
    tainted: bool = False  # a failover took back entries it may have shown (no replica reads here)
    gaps: list[str] = field(default_factory=list)
    history: list[str] = field(default_factory=list)  # entry:row/index+tokens of each delta read
    task: asyncio.Task | None = None
    connections: int = 0

    @property
    def live(self) -> bool:
        return self.task is not None and not self.task.done()

    def join(self, router: ReplyRouter, redis: Redis) -> None:
        self.connections += 1
        self.task = asyncio.ensure_future(self._follow(router, redis))

    async def hang_up(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    async def _follow(self, router: ReplyRouter, redis: Redis) -> None:
        # api/requests.py's events(): the resume index of Last-Event-ID, then the router
        last_id = self.last_id
        next_index = await resume_index(redis, MODEL, self.rid, last_id) if last_id != "0" else 0
        async for ev in router.follow(MODEL, self.rid, after=last_id, next_index=next_index):
            if ev.delta is not None:
                d = ev.delta
                want = self.next.get(d.row, 0)
                if d.i != want:
                    self.gaps.append(f"row {d.row}: got index {d.i}, expected {want} (connection {self.connections} "
                                     f"after {last_id}, resume index {next_index}; read {self.history[-6:]})")
                self.history.append(f"{ev.entry_id}:{d.row}/{d.i}+{len(d.token_ids)}")
                self.rows.setdefault(d.row, []).append(d.text)
                self.next[d.row] = d.i + len(d.token_ids)
            elif ev.final is not None:
                self.lost = ev.entry_id == self.last_id
                self.final = ev.final
            self.last_id = ev.entry_id
