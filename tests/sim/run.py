"""The seeded scheduler: a seed chooses every step (which actor does what, which fault lands
where); a failing run is shrunk to the shortest step list that still breaks the same invariant,
and printed as a replay."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from tests.broker.helpers import queued_len
from tests.sim.actors import settle
from tests.sim.clock import installed
from tests.sim.invariants import check_end, check_step
from tests.sim.world import KEYS, Server, Violation, World

Step = tuple[Any, ...]
ALL_FAULTS = ("crash", "freeze", "lose", "dup", "failover", "clock", "poison", "restart")
# (weight, step kind); faults only where the run allows them
WEIGHTS = {"admit": 8, "cancel": 1.5, "dlq": 1.5, "join": 7, "hangup": 2, "reconnect": 3, "fetch": 8, "start": 8,
           "resume": 5, "emit": 25, "flush": 9, "commit": 8, "lease": 2, "watch": 1.5, "crash": 1.5, "freeze": 3,
           "lose": 2, "dup": 1, "snapshot": 2, "failover": 1.5, "clock": 1.5, "poison": 1.5, "restart": 0.7}


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
    going = [(wi, rid, run) for wi, rid, run in runs if run.task is not None and not run.task.done()]
    # A failover that took back a read and a start (see fetch) leaves a run writing under them:
    # another worker reads and starts the same attempt afresh, then both write in small steps
    # (the fence must keep one of them out).
    lost = {wi for wi, rid, _ in going if rid in world.lost_starts}
    twins = [(wi, rid, run) for wi, rid, run in going if sum(1 for _, r, _ in going if r == rid) > 1]
    others = [wi for wi in range(len(world.workers)) if wi not in lost] or list(range(len(world.workers)))

    def fetch() -> Step:  # (a read of new entries is often where the replica a failover promotes was left behind)
        return ("fetch", rng.choice(others) if lost else rng.randrange(len(world.workers)), rng.choice([1, 2, 4]),
                "failover" in faults and world.unread > 0 and rng.random() < 0.3)
    enabled: dict[str, Callable[[], Step]] = {
        "admit": lambda: ("admit", rng.choice([1, 1, 1, 2]), rng.choice([1, 1, 2]), rng.random() < 0.5,
                          rng.random() < 0.25, rng.choice([0, 0, 1, 2, 3])),
        "fetch": fetch,
        "flush": lambda: ("flush", rng.randrange(len(world.workers))),
        "lease": lambda: ("lease", rng.randrange(len(world.workers))),
        "watch": lambda: ("watch", rng.randrange(len(world.workers))),
    }
    running_idx = [idx[rid] for _, rid, _ in runs]
    if world.requests:
        pick = lambda: rng.randrange(len(world.requests))  # noqa: E731
        dead = [idx[rid] for rid in world.dead if rid in idx]
        stale = [idx[rid] for rid in world.dead if rid in idx and rid in world.ledger.expired]  # its result expired
        def join() -> Step:  # mostly a request under way; sometimes while its worker flushes (a read under way)
            running = [idx[rid] for _, rid, _ in runs]
            # (often a second reader of a stream another reader is mid-way through: the router
            # has a read under way for it when the worker's flush lands)
            followed = [idx[r.rid] for r in world.readers if r.live and r.last_id != "0" and idx[r.rid] in running]
            if followed and rng.random() < 0.5:
                req = rng.choice(followed)
                return ("join", req, rng.choice([wi for wi, rid, _ in runs if idx[rid] == req]))
            req = rng.choice(running) if running and rng.random() < 0.7 else max(pick(), pick())
            with_flush = [wi for wi, rid, _ in runs if idx[rid] == req] + [-1]
            return ("join", req, rng.choice(with_flush))
        enabled.update(cancel=lambda: ("cancel", pick()),
                       dlq=lambda: ("dlq", rng.choice(stale or dead) if dead and rng.random() < 0.9 else pick(),
                                    rng.choice([0, 1, 1, 2, 2])),
                       join=join, dup=lambda: ("dup", pick()),  # (poison: mostly a request under way)
                       poison=lambda: ("poison", rng.choice(running_idx) if running_idx and rng.random() < 0.8
                                       else pick()))
    reading = [r.idx for r in world.readers if r.live and r.last_id != "0"]  # mid-stream
    gone = [r.idx for r in world.readers if not r.live and r.final is None]
    # (a reader mid-way through a multi-row stream hangs up after another row's event most often,
    # where that row is at another index than row 0)
    running_rids = {rid for _, rid, _ in going}
    past_row0 = [r.idx for r in world.readers if r.live and r.rid in running_rids and r.history
                 and (row := int(r.history[-1].rsplit(":", 1)[-1].split("/")[0])) != 0
                 and r.next.get(row) != r.next.get(0, 0)]
    if reading:
        enabled["hangup"] = lambda: ("hangup", rng.choice(past_row0 if past_row0 and rng.random() < 0.7 else reading))
    back = [r.idx for r in world.readers if not r.live and r.final is None and r.rid in running_rids]
    if gone:  # (mostly a reader of a request still under way: it resumes mid-stream)
        enabled["reconnect"] = lambda: ("reconnect", rng.choice(back if back and rng.random() < 0.8 else gone))
    fetched = [wi for wi, w in enumerate(world.workers) if w.fetched]
    if fetched:
        enabled["start"] = lambda: ("start", rng.choice(fetched), rng.randrange(4))
    waiting = [(wi, rid) for wi, rid, run in runs if run.task is None]
    if waiting:
        enabled["resume"] = lambda: (lambda wi, rid: ("resume", wi, idx[rid]))(*rng.choice(waiting))
    if going:
        def emit() -> Step:
            poisoned = [g for g in going if g[1] in world.poison]  # (its worker crashes on it: on to quarantine)
            wi, rid, run = rng.choice(twins if twins and rng.random() < 0.8 else
                                      poisoned if poisoned and rng.random() < 0.5 else going)
            # a retried structured row regenerates from token 0: its engine deltas are often
            # several tokens, one of them straddling the point the stream had reached
            regenerated = run.d.attempt > 1 and run.d.message.sampling.structured is not None
            rows = len(run.running.engine_ids)  # (a multi-row stream in small entries: rows at other indices)
            return ("emit", wi, idx[rid], rng.randrange(rows),
                    rng.choice([1, 1, 2] if twins or rows > 1 else [2, 3, 5, 8] if regenerated else [1, 1, 2, 3, 5]))
        enabled["emit"] = emit
    if twins:
        enabled["flush"] = lambda: ("flush", rng.choice(twins)[0])
    done = [(wi, rid) for wi, rid, run in runs if run.task is not None and run.task.done()]
    if done:
        enabled["commit"] = lambda: (lambda wi, rid: ("commit", wi, idx[rid]))(*rng.choice(done))
    busy = [wi for wi, w in enumerate(world.workers) if w.runs or w.fetched] or list(range(len(world.workers)))
    # (often the worker of a structured row under way: its retry regenerates from token 0)
    shaped = [wi for wi, _, run in going if run.d.message.sampling.structured is not None and run.d.attempt == 1]
    victim = lambda: rng.choice(shaped if shaped and rng.random() < 0.5 else busy)  # noqa: E731
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
    if "restart" in faults and world.server is not None:
        enabled["restart"] = lambda: ("restart",)
    if "clock" in faults:  # with a dead letter, mostly past its failed result's retention (then a dlq retry)
        enabled["clock"] = lambda: ("clock", rng.choice([700, 700, 200] if world.dead else [5, 30, 70, 200, 700, 700]))
    # Few requests at a time, each taken through more of its life (takeovers, retries, expiry).
    unfinished = len(set(world.ledger.accepted) - set(world.ledger.finals) - world.ledger.expired)
    weights = dict(WEIGHTS, admit=WEIGHTS["admit"] if unfinished < 3 else 0.5,
                   dlq=WEIGHTS["dlq"] * (2 if world.dead else 0.3), clock=WEIGHTS["clock"] * (2 if world.dead else 1))
    # A dead letter's failed result often expires before an operator retries it (the retry
    # re-creates its status): the clock first, then the retry.
    expired = {rid for rid in world.dead if rid in world.ledger.expired}
    if world.dead and not expired:
        weights.update(clock=6, dlq=1)
    elif expired:
        weights["dlq"] = 6
    # A failover is likeliest where it takes back a read and a start (see fetch) that a run still
    # writes under: another worker may then read and start the same attempt afresh. (A plain
    # run's: a structured row's tokens are the same whoever generates them.)
    if world.started_since_snapshot & {rid for _, rid, run in going if run.d.message.sampling.structured is None}:
        weights.update(failover=8, snapshot=0.2)
    if lost or twins:  # the rest of the faults wait while it plays out
        weights.update({k: 0.2 for k in ("crash", "freeze", "lose", "dup", "snapshot", "failover", "clock", "poison",
                                         "restart", "lease", "watch")})
    if lost and not twins:
        weights.update(fetch=WEIGHTS["fetch"] * 3, start=WEIGHTS["start"] * 2)
    if twins:
        weights.update(emit=50, flush=20, fetch=2, join=2, start=2, admit=0.5)
    weights["hangup"] = 8  # (enabled only while a reader is mid-stream)
    if back:
        weights["reconnect"] = 6
    if any(len(run.running.engine_ids) > 1 for _, _, run in going):
        weights["flush"] = 18
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
        for wi in range(len(world.workers)):
            while world.workers[wi].fetched:  # (a poison start crashes it: a new worker, nothing fetched)
                await do(("start", wi, 0))
            w = world.workers[wi]
            for rid, run in list(w.runs.items()):
                if world.workers[wi] is not w:  # crashed on a poison request: what it ran is gone
                    break
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
        # Queued is on a lane's stream or staged for its tenant's turn (fair share, prefix
        # affinity): a drain that looked at the streams alone left staged requests queued.
        if not await queued_len(world.redis, KEYS.requests) + await queued_len(world.redis, KEYS.bulk):
            return
        await world.age_pending()  # what is left is held by a crashed worker's old run, or a frozen one
        for wi in range(len(world.workers)):
            await do(("fetch", wi, 16))


async def play(redis: Redis, url: str, seed: int, *, steps: int | None = None, replay: list[Step] | None = None,
               faults: tuple[str, ...] = ALL_FAULTS, check_every: bool = True,
               server: Server | None = None) -> Outcome:
    """Run a seed's `steps` (drawn) or a given `replay`, checking after every step, then drain
    and check the end. `server`: the redis-server behind `url`, for restarts (none without it)."""
    rng = random.Random(seed)
    world = World(redis, url, seed, server)
    out = Outcome(steps=[])
    with installed(world.clock):
        await world.open()
        try:
            async def do(step: Step, drawn: bool = False) -> None:
                if drawn:
                    out.steps.append(step)
                out.log.append(f"{step} -> {await world.step(step)}")
                await world.observe()
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
                 faults: tuple[str, ...] = ALL_FAULTS, server: Server | None = None) -> Outcome:
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
                got = await play(redis, url, seed, replay=candidate, faults=faults, server=server)
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
