"""The seeded scheduler: a seed chooses every step (which actor does what, which fault lands
where); a failing run is shrunk to the shortest step list that still breaks the same invariant,
and printed as a replay."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from tests.sim.actors import settle
from tests.sim.clock import installed
from tests.sim.invariants import check_end, check_step
from tests.sim.world import KEYS, Violation, World

Step = tuple[Any, ...]
ALL_FAULTS = ("crash", "freeze", "lose", "dup", "failover", "clock", "poison")
# (weight, step kind); faults only where the run allows them
WEIGHTS = {"admit": 8, "cancel": 1.5, "dlq": 1.5, "join": 7, "hangup": 2, "reconnect": 3, "fetch": 8, "start": 8,
           "resume": 5, "emit": 25, "flush": 9, "commit": 8, "lease": 2, "watch": 1.5, "crash": 1.5, "freeze": 3,
           "lose": 2, "dup": 1, "snapshot": 2, "failover": 1.5, "clock": 1.5, "poison": 0.7}


@dataclass
class Outcome:
    steps: list[Step]
    violation: Violation | None = None
    at: int | None = None  # the index of the step after which it broke (None: at the end)
    log: list[str] = field(default_factory=list)


def choose(world: World, rng: random.Random, faults: tuple[str, ...]) -> Step:
    """One step the world can take now, drawn by weight among the enabled kinds."""
    idx = {r.message.id: r.idx for r in world.requests}
    runs = [(wi, rid, run) for wi, w in enumerate(world.workers) for rid, run in w.runs.items()]
    enabled: dict[str, Callable[[], Step]] = {
        "admit": lambda: ("admit", rng.choice([1, 1, 1, 2]), rng.choice([1, 1, 2]), rng.random() < 0.5,
                          rng.random() < 0.25, rng.choice([0, 0, 1, 2, 3])),
        "fetch": lambda: ("fetch", rng.randrange(len(world.workers)), rng.choice([1, 2, 4])),
        "flush": lambda: ("flush", rng.randrange(len(world.workers))),
        "lease": lambda: ("lease", rng.randrange(len(world.workers))),
        "watch": lambda: ("watch", rng.randrange(len(world.workers))),
    }
    if world.requests:
        pick = lambda: rng.randrange(len(world.requests))  # noqa: E731
        dead = [idx[rid] for rid in world.dead if rid in idx]
        def join() -> Step:  # mostly a request under way; sometimes while its worker flushes (a read under way)
            running = [idx[rid] for _, rid, _ in runs]
            req = rng.choice(running) if running and rng.random() < 0.7 else max(pick(), pick())
            with_flush = [wi for wi, rid, _ in runs if idx[rid] == req] + [-1]
            return ("join", req, rng.choice(with_flush))
        enabled.update(cancel=lambda: ("cancel", pick()),
                       dlq=lambda: ("dlq", rng.choice(dead) if dead and rng.random() < 0.9 else pick(),
                                    rng.choice([0, 1, 1, 2, 2])),
                       join=join, dup=lambda: ("dup", pick()), poison=lambda: ("poison", pick()))
    reading = [r.idx for r in world.readers if r.live and r.last_id != "0"]  # mid-stream
    gone = [r.idx for r in world.readers if not r.live and r.final is None]
    if reading:
        enabled["hangup"] = lambda: ("hangup", rng.choice(reading))
    if gone:
        enabled["reconnect"] = lambda: ("reconnect", rng.choice(gone))
    fetched = [wi for wi, w in enumerate(world.workers) if w.fetched]
    if fetched:
        enabled["start"] = lambda: ("start", rng.choice(fetched), rng.randrange(4))
    waiting = [(wi, rid) for wi, rid, run in runs if run.task is None]
    if waiting:
        enabled["resume"] = lambda: (lambda wi, rid: ("resume", wi, idx[rid]))(*rng.choice(waiting))
    going = [(wi, rid, run) for wi, rid, run in runs if run.task is not None and not run.task.done()]
    if going:
        def emit() -> Step:
            wi, rid, run = rng.choice(going)
            return ("emit", wi, idx[rid], rng.randrange(len(run.running.engine_ids)), rng.choice([1, 1, 2, 3, 5]))
        enabled["emit"] = emit
    done = [(wi, rid) for wi, rid, run in runs if run.task is not None and run.task.done()]
    if done:
        enabled["commit"] = lambda: (lambda wi, rid: ("commit", wi, idx[rid]))(*rng.choice(done))
    busy = [wi for wi, w in enumerate(world.workers) if w.runs or w.fetched] or list(range(len(world.workers)))
    # A worker holding a retried request is hit more often: requests go on through quarantine to
    # the dead-letter stream, so that `dlq retry` and `drop` have letters to work on.
    retried = [wi for wi, w in enumerate(world.workers) for run in w.runs.values() if run.d.attempt > 1]
    victim = lambda: rng.choice(retried if retried and rng.random() < 0.8 else busy)  # noqa: E731
    if "crash" in faults:
        enabled["crash"] = lambda: ("crash", victim())
    if "freeze" in faults:
        enabled["freeze"] = lambda: ("freeze", victim())
    if "lose" in faults:
        enabled["lose"] = lambda: ("lose", rng.randrange(-1, len(world.workers)))
    for kind in ("dup", "poison"):
        if kind not in faults:
            enabled.pop(kind, None)
    if "failover" in faults:
        enabled["snapshot"] = lambda: ("snapshot",)
        if world.snapshot is not None:
            enabled["failover"] = lambda: ("failover",)
    if "clock" in faults:  # with a dead letter, mostly past its failed result's retention (then a dlq retry)
        enabled["clock"] = lambda: ("clock", rng.choice([700, 700, 200] if world.dead else [5, 30, 70, 200, 700, 700]))
    # Few requests at a time, each taken through more of its life (takeovers, retries, expiry).
    unfinished = len(set(world.ledger.accepted) - set(world.ledger.finals) - world.ledger.expired)
    weights = dict(WEIGHTS, admit=WEIGHTS["admit"] if unfinished < 3 else 0.5,
                   dlq=WEIGHTS["dlq"] * (2 if world.dead else 0.3), clock=WEIGHTS["clock"] * (2 if world.dead else 1))
    # A failover is likeliest where it takes back a start (and the read before it) that a run is
    # still writing under: another worker may then read and start the same attempt afresh.
    if retried:
        weights.update(crash=WEIGHTS["crash"] * 3, freeze=WEIGHTS["freeze"] * 3)
    if world.started_since_snapshot and going:
        weights["failover"] = 8
    weights["hangup"] = 8  # (enabled only while a reader is mid-stream)
    kinds = sorted(enabled)
    kind = rng.choices(kinds, [weights[k] for k in kinds])[0]
    return enabled[kind]()


async def drain(world: World, do: Callable[[Step], Any]) -> None:
    """Faults stop; hung-up readers come back; every worker finishes what it holds, and the
    workers take over whatever is left (leases lapse) until the streams are empty."""
    for i, r in enumerate(world.readers):
        if not r.live and r.final is None:
            await do(("reconnect", i))
    idx = {r.message.id: r.idx for r in world.requests}
    for _ in range(40):
        for wi, w in enumerate(world.workers):
            while w.fetched:
                await do(("start", wi, 0))
            for rid, run in list(w.runs.items()):
                if run.task is None:
                    await do(("resume", wi, idx[rid]))
                for _ in range(3):
                    if run.task is None or run.task.done():
                        break
                    for row in range(len(run.running.engine_ids)):
                        await do(("emit", wi, idx[rid], row, 8))
                    await settle()
                await do(("commit", wi, idx[rid]))
            await do(("flush", wi))
        if not await world.redis.xlen(KEYS.requests) + await world.redis.xlen(KEYS.bulk):
            return
        await world.age_pending()  # what is left is held by a crashed worker's old run, or a frozen one
        for wi in range(len(world.workers)):
            await do(("fetch", wi, 16))


async def play(redis: Redis, url: str, seed: int, *, steps: int | None = None, replay: list[Step] | None = None,
               faults: tuple[str, ...] = ALL_FAULTS, check_every: bool = True) -> Outcome:
    """Run a seed's `steps` (drawn) or a given `replay`, checking after every step, then drain
    and check the end."""
    rng = random.Random(seed)
    world = World(redis, url, seed)
    out = Outcome(steps=[])
    with installed(world.clock):
        await world.open()
        try:
            async def do(step: Step, drawn: bool = False) -> None:
                if drawn:
                    out.steps.append(step)
                out.log.append(f"{step} -> {await world.step(step)}")
                world.dead = [f.get("id", "") for _, f in await redis.xrange(KEYS.dead_letters)]
                await world.catch_up()
                if check_every:
                    await check_step(world)
            try:
                total = len(replay) if replay is not None else (steps or 0)
                for i in range(total):
                    out.at = i
                    await do(replay[i] if replay is not None else choose(world, rng, faults), drawn=True)
                out.at = None
                await drain(world, do)
                await check_end(world)
            except Violation as v:
                out.violation = v
        finally:
            await world.close()
    return out


async def shrink(redis: Redis, url: str, seed: int, failing: Outcome, *, budget: int = 150,
                 faults: tuple[str, ...] = ALL_FAULTS) -> Outcome:
    """Delta debugging over the step list: drop chunks (halves, quarters ... single steps) while
    the same invariant still breaks; at most `budget` replays. Admissions are kept in a first
    pass (steps name requests by their admission order, which dropping one would shift)."""
    assert failing.violation is not None
    best = failing
    steps = failing.steps[: (failing.at + 1) if failing.at is not None else len(failing.steps)]
    want = failing.violation.invariant
    tries = 0
    for keep_admissions in (True, False):
        n = 2
        while tries < budget:
            movable = [i for i, s in enumerate(steps) if not (keep_admissions and s[0] == "admit")]
            if len(movable) < 2 and n > 2:
                break
            size = max(len(movable) // n, 1)
            cut = False
            for start in range(0, len(movable), size):
                if tries >= budget:
                    break
                drop = set(movable[start:start + size])
                candidate = [s for i, s in enumerate(steps) if i not in drop]
                tries += 1
                got = await play(redis, url, seed, replay=candidate, faults=faults)
                if got.violation is not None and got.violation.invariant == want:
                    steps, best, cut = candidate, got, True
                    n = max(n - 1, 2)
                    break
            if not cut:
                if size == 1:
                    break
                n = min(n * 2, max(len(movable), 2))
    best.steps = steps
    return best


def replay_text(seed: int, outcome: Outcome) -> str:
    lines = [f"seed {seed}: {outcome.violation}", f"minimal replay ({len(outcome.steps)} steps):"]
    lines += [f"  {s!r}," for s in outcome.steps]
    lines += ["what each step did:"] + [f"  {line}" for line in outcome.log[-len(outcome.steps) - 40:]]
    return "\n".join(lines)
