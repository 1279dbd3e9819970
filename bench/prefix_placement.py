"""Which workers own a prefix group: rendezvous hashing, and its assignment with bounded loads.

The pull side of prefix affinity will take these to broker/ (docs/prefix-affinity.md, Plan);
the placement simulator (bench/prefix_sim.py) uses them as they are.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable


def _score(group: str, worker: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{group}|{worker}".encode(), digest_size=8).digest(), "big")


def rendezvous_ranks(group: str, workers: list[str], k: int) -> list[str]:
    """The `k` live workers that rank highest for `group` (highest random weight), best first."""
    return sorted(workers, key=lambda w: _score(group, w), reverse=True)[:k]


def bounded_owners(counts: dict[str, int], workers: list[str], bound: float, ranks: Callable[[str], list[str]],
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
