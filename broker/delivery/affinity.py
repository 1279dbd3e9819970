"""Prefix affinity, the pull side (docs/prefix-affinity.md): which live workers own a prefix
group, and the heartbeat step that gives the groups requested lately their owners.

Placement is decided in dispatch.lua, where a worker's fetch moves staged entries onto the
lane: it prefers entries of the groups it owns. This module keeps the owners table that script
reads (`<tag>:aff:owners`), recomputed once per heartbeat interval by one worker of the shard
(rendezvous hashing with bounded loads, sticky), and records each worker's free slots between
its fetches (`<tag>:aff:slots`: what says which workers are live, and how free). The owners
are a hint: a stale or lost table costs cache hits, never a delivery guarantee.

Ranks are the highest SHA-1 of `group|worker` (hex compared as strings): dispatch.lua computes
the same with `redis.sha1hex` for a group the table does not name yet.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from redis.asyncio import Redis

from sluice.broker.delivery.calls import AffinityBeat, AffinityOwners
from sluice.broker.keys import AFFINITY_GROUPS_MAX, WORKERS, affinity_wake
from sluice.protocol.prefix import prefix_group

if TYPE_CHECKING:
    from sluice.broker.plumbing import Scripts
    from sluice.config.model import ModelConfig
    from sluice.config.settings import Settings

GROUP_BLOCKS = 16  # a group is a request's prefix key covering at most 16 blocks (256 tokens at vLLM's 16)
BOUNDED_LOAD = 1.3  # a worker owns groups worth at most this times the mean load
WINDOW = 32  # staged entries of a tenant a dispatch looks at, oldest first


def group_of(prefix: list[str]) -> str:
    """The group an entry is placed by ('' for an entry without prefix keys: placed as FIFO)."""
    return prefix_group(prefix, GROUP_BLOCKS) or ""


def _score(group: str, worker: str) -> str:
    return hashlib.sha1(f"{group}|{worker}".encode()).hexdigest()


def rendezvous_ranks(group: str, workers: list[str], k: int | None = None) -> list[str]:
    """The live workers ranked for `group` (highest random weight), best first; the first `k`."""
    return sorted(workers, key=lambda w: _score(group, w), reverse=True)[:k]


def bounded_owners(counts: dict[str, float], workers: list[str], bound: float,
                   ranks: Callable[[str], list[str]], before: dict[str, list[str]] | None = None, *,
                   sizes: dict[str, float] | None = None,
                   room: dict[str, float] | None = None) -> dict[str, list[str]]:
    """Each group's owners: its owners `before` that are still live, then the highest-ranked
    workers, as long as they have room, where a worker's room is `bound` times the mean of the
    requests these groups made (heaviest group first; a group heavier than one worker's room gets
    as many as it fills). Consistent hashing with bounded loads over rendezvous ranks, sticky: a
    group moves only when its worker leaves or is over its bound, so caches stay warm.

    With `room` (a worker's prefix-cache room, in tokens) and `sizes` (the tokens a group's
    prompt leaves in a cache), a worker also owns no more prompts than its cache keeps: a group
    goes to the workers whose cache has room left for it, and only a group no cache with load to
    spare has room for is placed by load alone (it evicts wherever it goes; the lightest come last)."""
    before = before or {}
    cap = bound * sum(counts.values()) / len(workers)
    load = dict.fromkeys(workers, 0.0)
    cached = dict.fromkeys(workers, 0.0)
    owners: dict[str, list[str]] = {}
    for group, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        size = (sizes or {}).get(group, 0.0)
        kept = [w for w in before.get(group, ()) if w in load]
        order = kept + [w for w in ranks(group) if w in load and w not in kept]
        fits = order if room is None else [w for w in order if cached[w] + size <= room.get(w, float("inf"))]
        mine = _take(float(n), fits, load, cap) or _take(float(n), order, load, cap)
        for w in mine:
            cached[w] += size
        owners[group] = mine or [min(workers, key=load.__getitem__)]
    return owners


def _take(n: float, order: list[str], load: dict[str, float], cap: float) -> list[str]:
    """The workers of `order` that take a group's `n` requests, each up to `cap` in all."""
    mine: list[str] = []
    for w in order:
        if n <= 0:
            break
        room = cap - load[w]
        if room <= 0:
            continue
        taken = min(room, n)
        load[w] += taken
        n -= taken
        mine.append(w)
    return mine


@dataclass(frozen=True)
class PlacementRules:
    """Whether and how a worker places by prefix: the bound another worker's group waits for
    its owners (`wait_ms`, None when the worker does not place by prefix), who counts as live
    (seen within `live_ms`), and how often one worker of a shard recomputes the owners."""

    wait_ms: int | None = None
    live_ms: int = 10_000
    interval_ms: int = 2_000

    @classmethod
    def of(cls, settings: Settings, model: ModelConfig) -> PlacementRules:
        """Placing by prefix where the deployment asks for it and fair share stages requests."""
        placing = model.prefix_affinity and settings.fair_share
        return cls(wait_ms=round(settings.prefix_affinity_wait_ms) if placing else None,
                   live_ms=round(settings.worker_ttl_s * 1000),
                   interval_ms=round(settings.heartbeat_interval_s * 1000))


@dataclass
class Placement:
    """A worker's side of prefix affinity, kept by its consumer: its rules, the interactive
    streams it reads (`lanes`: a sharded model's every shard), where each lane's doorbell was
    read to (`wake`, set by each dispatch), and the heartbeat's part: its free slots recorded
    and, once per `interval_ms` on one worker of a shard, the owners."""

    scripts: Scripts
    redis: Redis  # where the workers' heartbeats say how large their prefix caches are
    rules: PlacementRules = field(default_factory=PlacementRules)
    lanes: list[str] = field(default_factory=list)
    wake: dict[str, tuple[str, int]] = field(default_factory=dict)
    placing: bool = False  # its last heartbeat recorded it: a worker that stops placing leaves

    async def stop(self, consumer: str) -> None:
        """A stopping worker's groups go to their next ranks at once."""
        self.rules = dataclasses.replace(self.rules, wait_ms=None)
        await self.heartbeat(consumer, 0)

    async def heartbeat(self, consumer: str, free: int) -> None:
        """Each interactive stream's: `free` recorded (or, no longer placing, the worker leaves)."""
        placing = self.rules.wait_ms is not None
        for stream in self.lanes:
            if placing:
                await self.beat(stream, consumer, free)
            elif self.placing:
                await self.leave(stream, consumer)
        self.placing = placing

    async def beat(self, stream: str, consumer: str, free: int) -> dict[str, list[str]] | None:
        """Record `free` for `consumer`; the owners written when this call recomputed them."""
        got = await self.scripts(AffinityBeat(tag=stream, consumer=consumer, free=free,
                                              live_ms=self.rules.live_ms, interval_ms=self.rules.interval_ms))
        if not got:
            return None
        live, counts, before, sizes = got[0], _pairs(got[1]), _pairs(got[2]), _pairs(got[3])
        if not live or not (counts or before):
            return None
        beats = await self.redis.hmget(WORKERS, live)
        room, block = cache_room([json.loads(raw) if raw else {} for raw in beats], live)
        footprint = {g: full_blocks(int(n), block) for g, n in sizes.items()} if block else {}
        ranked: dict[str, list[str]] = {}

        def ranks(group: str) -> list[str]:
            if group not in ranked:
                ranked[group] = rendezvous_ranks(group, live)
            return ranked[group]

        owners = bounded_owners({g: float(n) for g, n in counts.items()}, live, BOUNDED_LOAD, ranks,
                                {g: o.split(",") for g, o in before.items()}, room=room, sizes=footprint)
        for group, was in before.items():
            # A group not requested lately keeps its live owners: dropped, it would go back to its
            # rank-1 worker, which is not where the room bound may have put it (and its cache is).
            still = [w for w in was.split(",") if w in live]
            if group not in owners and still and len(owners) < AFFINITY_GROUPS_MAX:
                owners[group] = still
        pairs = tuple(x for g, o in owners.items() for x in (g, ",".join(o)))
        await self.scripts(AffinityOwners(owners=stream, ttl_ms=4 * self.rules.interval_ms, groups=pairs))
        return owners

    async def leave(self, stream: str, consumer: str) -> None:
        """A worker stopping (or no longer placing by prefix): its groups go to their next ranks at once."""
        await self.scripts(AffinityBeat(tag=stream, consumer=consumer, free=-1, live_ms=self.rules.live_ms,
                                        interval_ms=0))

    async def wait(self, stream: str, block_ms: int) -> None:
        """Block on the lane's doorbell from where the last dispatch read it, at most `block_ms`,
        and no longer than until the entry that dispatch looked at first falls due."""
        wake_id, due_ms = self.wake.pop(stream)
        await self.redis.xread({affinity_wake(stream): wake_id}, count=1,
                               block=max(1, min(block_ms, due_ms)) if due_ms >= 0 else block_ms)


def cache_room(infos: list[dict[str, Any]], live: list[str]) -> tuple[dict[str, float] | None, int]:
    """Each live worker's room for the prompts it owns, in tokens, from its heartbeat (`infos`,
    in the order of `live`): its prefix cache less one block for each request the workers run
    on average (a running request holds its last, partial block alone), and the cache's block
    size; (None, 0) while a worker's cache size is not known (no room bound then)."""
    blocks = [int(info.get("prefix_cache_blocks") or 0) for info in infos]
    sizes = [int(info.get("prefix_cache_block_size") or 0) for info in infos]
    if not all(blocks) or not all(sizes):
        return None, 0
    running = math.ceil(sum(info.get("in_flight") or 0 for info in infos) / len(infos))
    return {w: float((n - running) * size) for w, n, size in zip(live, blocks, sizes)}, min(sizes)


def full_blocks(tokens: int, block: int) -> float:
    """The tokens of a prompt of `tokens` that a prefix cache keeps: its full blocks."""
    return float(tokens // block * block)


def _pairs(flat: list[str]) -> dict[str, str]:
    return dict(zip(flat[::2], flat[1::2]))
