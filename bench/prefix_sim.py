"""A placement simulator for prefix affinity (issue 34): pure Python, no Redis, no engine.

Workers pull from one queue as Sluice's do (a free slot asks for one entry); a policy decides
which waiting entry a worker takes, or none for now. Each worker has a simulated prefix cache
(workers/engines/prefix_cache.py: LRU over chained block hashes, as the null engine's) and a
prefill unit that computes uncached prompt tokens one request after another at a fixed cost per
token (compute-bound, as a GPU's prefill is); decoding then holds the slot for a fixed time per
output token. Hits therefore show in time to first token and, once prefill is the bottleneck,
in throughput.

Policies (`POLICIES`):
- `fifo`: the oldest waiting entry, whoever asks (random placement, Sluice without affinity).
- `digest`: each worker reports in its heartbeat (every `heartbeat_s`) the prefix groups it
  served most recently (`digest_size` of them); a worker takes the oldest entry of a group in its
  own digest, else one of a group in no other worker's digest, else one that has waited
  `max_wait_s`, else (idle) anything.
- `rendezvous`: each prefix group belongs to the live worker that ranks highest for it
  (rendezvous hashing: a worker leaving moves only its own groups); a worker takes the oldest
  entry of its own groups, else one whose group ranks it next after its owners (`spill_ranks`)
  while they have no free slot (a full owner's group goes to one more cache, always the same,
  at once), else one that has waited `max_wait_s`, else (idle) one whose owners have no free
  slot. `spill_ranks=1` is plain ownership. (Spilling whenever the owners ran 2 more requests
  than the taker cost 2 to 5 points of hit rate and up to 39 ms of TTFT p99: it spread hot
  groups while their owners still had room.)
- `oracle`: knows every cache exactly; a worker takes the oldest entry whose prefix it holds at
  least as deeply as any other worker (and more than nothing), else one nobody holds, else one
  that has waited `max_wait_s`, else (idle) anything. The bar the others are measured against.

Requests are grouped by `protocol.prefix.prefix_group` of their real prefix keys (the deepest key
within `group_blocks` blocks), as the pull side will group them.
"""

from __future__ import annotations

import heapq
import random
import statistics
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from sluice.bench.prefix_workload import Entry, SimConfig, workload
from sluice.broker.delivery.affinity import bounded_owners, cache_room, full_blocks, rendezvous_ranks
from sluice.protocol.prefix import block_hashes
from sluice.workers.engines.prefix_cache import SimulatedPrefixCache

POLICIES = ("fifo", "digest", "rendezvous", "oracle")
WINDOW = 256  # waiting entries a pull looks at, oldest first (a dispatch script's bounded scan)


@dataclass
class WorkerState:
    name: str
    cache: SimulatedPrefixCache
    free: int
    prefill_free_at: float = 0.0
    served: int = 0
    recent: OrderedDict[str, None] = field(default_factory=OrderedDict)  # groups, most recent last
    digest: frozenset[str] = frozenset()  # what its last heartbeat reported


@dataclass
class SimResult:
    policy: str
    hit_rate: float
    ttft_p50_s: float
    ttft_p99_s: float
    throughput_rps: float
    share_max_over_mean: float
    longest_extra_wait_s: float  # the longest a request waited while some worker had a free slot

    def row(self, oracle_hit_rate: float) -> dict[str, float | str]:
        return {"policy": self.policy, "hit_rate": round(self.hit_rate, 3),
                "vs_oracle": round(self.hit_rate / oracle_hit_rate, 3) if oracle_hit_rate else 0.0,
                "ttft_p50_ms": round(1000 * self.ttft_p50_s, 1),
                "ttft_p99_ms": round(1000 * self.ttft_p99_s, 1),
                "throughput_rps": round(self.throughput_rps, 1),
                "share_max/mean": round(self.share_max_over_mean, 2)}


Pick = Callable[[WorkerState, list[Entry], float], Entry | None]


class Simulation:
    def __init__(self, config: SimConfig, policy: str):
        if policy not in POLICIES:
            raise ValueError(f"policy: one of {', '.join(POLICIES)}")
        self.config, self.policy = config, policy
        self.workers = [WorkerState(f"w{i}", SimulatedPrefixCache(config.cache_blocks, config.block_size),
                                    free=config.slots) for i in range(config.workers)]
        self.names = [w.name for w in self.workers]
        self.by_name = {w.name: w for w in self.workers}
        self.ranks: dict[str, list[str]] = {}
        self.owners: dict[str, list[str]] = {}  # bounded loads: the groups of the last interval
        self.interval_counts: dict[str, float] = {}  # group -> requests this interval (bounded loads)
        self.rnd = random.Random(config.seed + 1)
        self.pick: Pick = getattr(self, f"_pick_{policy}")

    # -- policies: which waiting entry (oldest first) this worker takes now, if any
    def _overdue_or_idle(self, w: WorkerState, waiting: list[Entry], now: float,
                         can_start_elsewhere: Callable[[Entry], bool]) -> Entry | None:
        """The oldest entry once it has waited max_wait_s; before that, for a worker running
        nothing, as `idle_pulls` says (`can_start_elsewhere`: its preferred worker has a free slot)."""
        if waiting[0].arrived + self.config.max_wait_s <= now + 1e-12:
            return waiting[0]
        if w.free < self.config.slots or self.config.idle_pulls == "off":
            return None
        if self.config.idle_pulls == "any":
            return waiting[0]
        return next((e for e in waiting[:WINDOW] if not can_start_elsewhere(e)), None)

    def _pick_fifo(self, w: WorkerState, waiting: list[Entry], now: float) -> Entry | None:
        return waiting[0]

    def _ranked(self, group: str) -> list[str]:
        ranks = self.ranks.get(group)
        if ranks is None:
            ranks = self.ranks[group] = rendezvous_ranks(group, self.names, len(self.names))
        return ranks

    def _owners(self, group: str) -> list[str]:
        return self.owners.get(group) or self._ranked(group)[:1]

    def _pick_rendezvous(self, w: WorkerState, waiting: list[Entry], now: float) -> Entry | None:
        spill = None
        for e in waiting[:WINDOW]:
            owners = self._owners(e.group)
            if w.name in owners:
                return e
            if spill is None and w.name in self._ranked(e.group)[:len(owners) + self.config.spill_ranks - 1]:
                if max(self.by_name[o].free for o in owners) <= 0:
                    spill = e  # its owners are full: the next rank takes it now, not whoever is first later
        return spill or self._overdue_or_idle(
            w, waiting, now, lambda e: any(self.by_name[o].free for o in self._owners(e.group)))

    def _beat(self) -> None:
        if self.policy == "digest":
            for w in self.workers:
                w.digest = frozenset(w.recent)
        elif self.policy == "rendezvous" and self.config.bounded_load and self.interval_counts:
            # the caches' room and the prompts' size as the workers' recompute counts them
            c = self.config
            heartbeats = [{"prefix_cache_blocks": c.cache_blocks, "prefix_cache_block_size": c.block_size,
                           "in_flight": c.slots - w.free} for w in self.workers]
            room, _ = cache_room(heartbeats, self.names)
            size = full_blocks(c.prefix_tokens + sum(c.user_tokens) // 2, c.block_size)
            self.owners = bounded_owners(self.interval_counts, self.names, c.bounded_load, self._ranked,
                                         self.owners, room=room,
                                         sizes=dict.fromkeys(self.interval_counts, size))
            self.interval_counts = {}

    def _pick_digest(self, w: WorkerState, waiting: list[Entry], now: float) -> Entry | None:
        others = set().union(*(o.digest for o in self.workers if o is not w))
        unclaimed = None
        for e in waiting[:WINDOW]:
            if e.group in w.digest:
                return e
            if unclaimed is None and e.group not in others:
                unclaimed = e
        return unclaimed or self._overdue_or_idle(
            w, waiting, now,
            lambda e: any(o.free for o in self.workers if o is not w and e.group in o.digest))

    def _pick_oracle(self, w: WorkerState, waiting: list[Entry], now: float) -> Entry | None:
        nobody = None
        for e in waiting[:WINDOW]:
            mine = w.cache.cached_blocks(e.blocks)
            best = max(o.cache.cached_blocks(e.blocks) for o in self.workers)
            if mine and mine >= best:
                return e
            if nobody is None and best == 0:
                nobody = e
        return nobody or self._overdue_or_idle(w, waiting, now, lambda e: self._best_holder(e, w).free > 0)

    def _best_holder(self, e: Entry, w: WorkerState) -> WorkerState:
        return max((o for o in self.workers if o is not w), key=lambda o: o.cache.cached_blocks(e.blocks))

    # -- the run
    def run(self, entries: list[Entry]) -> SimResult:
        c = self.config
        events: list[tuple[float, int, str, object]] = []  # (time, order, kind, payload)
        order = 0

        def at(t: float, kind: str, payload: object = None) -> None:
            nonlocal order
            order += 1
            heapq.heappush(events, (t, order, kind, payload))

        for e in entries:
            at(e.arrived, "arrive", e)
        if self.policy in ("digest", "rendezvous"):
            at(c.heartbeat_s, "beat")
        waiting: list[Entry] = []
        ttft: list[float] = []
        extra_wait = 0.0
        last_done = 0.0
        done = 0
        while events:
            now, _, kind, payload = heapq.heappop(events)
            if kind == "arrive":
                assert isinstance(payload, Entry)
                waiting.append(payload)
                self.interval_counts[payload.group] = self.interval_counts.get(payload.group, 0) + 1
                at(payload.arrived + c.max_wait_s, "due")
            elif kind == "done":
                assert isinstance(payload, WorkerState)
                payload.free += 1
                done += 1
                last_done = now
            elif kind == "beat":
                self._beat()
                if done < len(entries):
                    at(now + c.heartbeat_s, "beat")
            self._dispatch(waiting, now, at, ttft)
            if waiting and any(w.free for w in self.workers):
                extra_wait = max(extra_wait, now - waiting[0].arrived)
        queries = sum(w.cache.counters.queries for w in self.workers)
        hits = sum(w.cache.counters.hits for w in self.workers)
        shares = [w.served for w in self.workers]
        return SimResult(self.policy, hits / queries if queries else 0.0, _pct(ttft, 50), _pct(ttft, 99),
                         len(entries) / last_done if last_done else 0.0,
                         max(shares) / statistics.mean(shares), extra_wait)

    def _dispatch(self, waiting: list[Entry], now: float, at: Callable[..., None], ttft: list[float]) -> None:
        """Every worker with a free slot asks for an entry, in random order, until none takes one."""
        progress = True
        while waiting and progress:
            progress = False
            free = [w for w in self.workers if w.free]
            self.rnd.shuffle(free)
            for w in free:
                if not waiting:
                    break
                e = self.pick(w, waiting, now)
                if e is None:
                    continue
                waiting.remove(e)
                self._start(w, e, now, at, ttft)
                progress = True

    def _start(self, w: WorkerState, e: Entry, now: float, at: Callable[..., None],
               ttft: list[float]) -> None:
        c = self.config
        hits = w.cache.admit(e.blocks, e.prompt_tokens)
        begin = max(now, w.prefill_free_at)
        first_token = begin + (e.prompt_tokens - hits) * c.prefill_s_per_token
        w.prefill_free_at = first_token
        w.free -= 1
        w.served += 1
        w.recent[e.group] = None
        w.recent.move_to_end(e.group)
        while len(w.recent) > c.digest_size:
            w.recent.popitem(last=False)
        ttft.append(first_token - e.arrived)
        at(first_token + c.output_tokens * c.decode_s_per_token, "done", w)


def _pct(values: list[float], q: int) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def simulate(config: SimConfig, policies: tuple[str, ...] = POLICIES) -> list[SimResult]:
    """Every policy over the same requests (one workload, drawn from the seed)."""
    entries = workload(config)
    return [Simulation(config, p).run(entries) for p in policies]


def best_worker_hit_rate(prompts: list[list[int]], workers: int, blocks: int, block_size: int) -> float:
    """The oracle of a real run (bench/prefix_real.py): its prompts (token ids) in the order sent,
    each to the worker whose cache holds most of its leading blocks (on a tie, the one that has
    served fewest), over `workers` simulated caches of the real engines' size in blocks. Its hit
    rate, counted as vLLM counts, is what always picking the best worker gets with those caches."""
    caches = [SimulatedPrefixCache(blocks, block_size) for _ in range(workers)]
    served = [0] * workers
    for ids in prompts:
        chain = block_hashes(ids, block_size)
        held = [c.cached_blocks(chain) for c in caches]
        best = max(range(workers), key=lambda i: (held[i], -served[i]))
        served[best] += 1
        caches[best].admit(chain, len(ids))
    queries = sum(c.counters.queries for c in caches)
    return sum(c.counters.hits for c in caches) / queries if queries else 0.0
