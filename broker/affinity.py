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

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from redis.asyncio import Redis

from sluice.broker.keys import affinity_wake
from sluice.protocol.prefix import prefix_group

if TYPE_CHECKING:
    from sluice.broker.scripts import Scripts
    from sluice.config.model import ModelConfig
    from sluice.config.settings import Settings

GROUP_BLOCKS = 16  # a group is a request's prefix key covering at most 16 blocks (256 tokens at vLLM's 16)
BOUNDED_LOAD = 1.3  # a worker owns groups worth at most this times the mean load
WINDOW = 32  # staged entries of a tenant a dispatch looks at, oldest first
GROUPS_MAX = 4096  # distinct groups counted per interval (more are placed by rank alone)


def group_of(prefix: list[str]) -> str:
    """The group an entry is placed by ('' for an entry without prefix keys: placed as FIFO)."""
    return prefix_group(prefix, GROUP_BLOCKS) or ""


def _score(group: str, worker: str) -> str:
    return hashlib.sha1(f"{group}|{worker}".encode()).hexdigest()


def rendezvous_ranks(group: str, workers: list[str], k: int | None = None) -> list[str]:
    """The live workers ranked for `group` (highest random weight), best first; the first `k`."""
    return sorted(workers, key=lambda w: _score(group, w), reverse=True)[:k]


def bounded_owners(counts: dict[str, float], workers: list[str], bound: float, ranks: Callable[[str], list[str]],
                   before: dict[str, list[str]] | None = None) -> dict[str, list[str]]:
    """Each group's owners: its owners `before` that are still live, then the highest-ranked
    workers, as long as they have room, where a worker's room is `bound` times the mean of the
    requests these groups made (heaviest group first; a group heavier than one worker's room gets
    as many as it fills). Consistent hashing with bounded loads over rendezvous ranks, sticky: a
    group moves only when its worker leaves or is over its bound, so caches stay warm."""
    before = before or {}
    cap = bound * sum(counts.values()) / len(workers)
    load = dict.fromkeys(workers, 0.0)
    owners: dict[str, list[str]] = {}
    for group, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        left, mine = float(n), []
        kept = [w for w in before.get(group, ()) if w in load]
        for w in kept + [w for w in ranks(group) if w in load and w not in kept]:
            if left <= 0:
                break
            room = cap - load[w]
            if room <= 0:
                continue
            taken = min(room, left)
            load[w] += taken
            left -= taken
            mine.append(w)
        owners[group] = mine or [min(workers, key=load.__getitem__)]
    return owners


@dataclass
class Placement:
    """A worker's side of prefix affinity, kept by its consumer: the bound (`wait_ms`, None when
    the worker does not place by prefix), who counts as live (seen within `live_ms`), where each
    lane's doorbell was read to (`wake`, set by each dispatch), and the heartbeat's part: its
    free slots recorded and, once per `interval_ms` on one worker of a shard, the owners."""

    scripts: Scripts
    lanes: Callable[[], list[str]]  # the interactive streams its worker reads (a sharded model's every shard)
    wait_ms: int | None = None
    live_ms: int = 10_000
    interval_ms: int = 2_000
    wake: dict[str, tuple[str, int]] = field(default_factory=dict)
    placing: bool = False  # its last heartbeat recorded it: a worker that stops placing leaves

    def configure(self, settings: Settings, model: ModelConfig) -> None:
        """Placing by prefix where the deployment asks for it and fair share stages requests."""
        placing = model.prefix_affinity and settings.fair_share
        self.wait_ms = round(settings.prefix_affinity_wait_ms) if placing else None
        self.live_ms = round(settings.worker_ttl_s * 1000)
        self.interval_ms = round(settings.heartbeat_interval_s * 1000)

    async def stop(self, consumer: str) -> None:
        """A stopping worker's groups go to their next ranks at once."""
        self.wait_ms = None
        await self.heartbeat(consumer, 0)

    async def heartbeat(self, consumer: str, free: int) -> None:
        """Each interactive stream's: `free` recorded (or, no longer placing, the worker leaves)."""
        for stream in self.lanes():
            if self.wait_ms is not None:
                await self.beat(stream, consumer, free)
            elif self.placing:
                await self.leave(stream, consumer)
        self.placing = self.wait_ms is not None

    async def beat(self, stream: str, consumer: str, free: int) -> dict[str, list[str]] | None:
        """Record `free` for `consumer`; the owners written when this call recomputed them."""
        got = await self.scripts.affinity_beat(keys=[stream], args=[consumer, free, self.live_ms, self.interval_ms])
        if not got:
            return None
        live, counts, before = got[0], _pairs(got[1]), _pairs(got[2])
        if not live or not counts:
            return None
        ranked: dict[str, list[str]] = {}

        def ranks(group: str) -> list[str]:
            if group not in ranked:
                ranked[group] = rendezvous_ranks(group, live)
            return ranked[group]

        owners = bounded_owners({g: float(n) for g, n in counts.items()}, live, BOUNDED_LOAD, ranks,
                                {g: o.split(",") for g, o in before.items()})
        pairs = (x for g, o in owners.items() for x in (g, ",".join(o)))
        await self.scripts.affinity_owners(keys=[stream], args=[4 * self.interval_ms, *pairs])
        return owners

    async def leave(self, stream: str, consumer: str) -> None:
        """A worker stopping (or no longer placing by prefix): its groups go to their next ranks at once."""
        await self.scripts.affinity_beat(keys=[stream], args=[consumer, -1, self.live_ms, 0])

    async def wait(self, redis: Redis, stream: str, block_ms: int) -> None:
        """Block on the lane's doorbell from where the last dispatch read it, at most `block_ms`,
        and no longer than until the entry that dispatch looked at first falls due."""
        wake_id, due_ms = self.wake.pop(stream)
        await redis.xread({affinity_wake(stream): wake_id}, count=1,
                          block=max(1, min(block_ms, due_ms)) if due_ms >= 0 else block_ms)


def _pairs(flat: list) -> dict[str, str]:
    return dict(zip(flat[::2], flat[1::2]))
