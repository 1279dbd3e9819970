"""A model's queue figures, per lane: requests waiting for a worker, requests workers hold, and
how long the oldest waiting one has waited.

Entries are deleted once acknowledged, so a stream holds exactly the waiting entries (after the
consumer group's last-delivered id: no worker has fetched them) and the held ones (the group's
pending entries: running, in a batch being formed, or leased by a worker that stopped, until
another reclaims them). Requests staged for their tenant's turn (fair share, broker/lua/dispatch.lua)
wait too. What `max_queued` bounds is all of them together (broker/lua/admit.lua).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from redis.asyncio import Redis

from sluice.broker import keys
from sluice.broker.keys import GROUP, ModelKeys

LANES = ("interactive", "bulk")


@dataclass(frozen=True)
class LaneFigures:
    waiting: int = 0  # on the stream, fetched by no worker yet
    running: int = 0  # fetched by a worker and not finished (the group's pending entries)
    oldest_waiting_s: float = 0.0  # how long the oldest waiting entry has waited (0: none waits)

    @property
    def entries(self) -> int:
        """Waiting plus running: what the model's queue bound counts."""
        return self.waiting + self.running

    def view(self) -> dict[str, int | float]:
        """As the api shows it (dashboard, GET /v1/models/{model})."""
        return {"waiting": self.waiting, "running": self.running,
                "oldest_waiting_s": round(self.oldest_waiting_s, 1)}


def _ms(entry_id: str) -> int:
    return int(entry_id.split("-", 1)[0])


def _group(answer: object) -> dict | None:
    """The workers' group among XINFO GROUPS' answer (an error: no stream yet)."""
    if not isinstance(answer, list):
        return None
    return next((g for g in answer if g.get("name") == GROUP), None)


async def queue_figures(redis: Redis, model: str, shards: int = 1) -> dict[str, LaneFigures]:
    """Per lane (interactive: summed over the shards): waiting, running, and the oldest waiting
    entry's age. Two round trips at most, whatever the queue holds."""
    mk = ModelKeys(model)
    streams = [("interactive", k.requests) for k in mk.shards(shards)] + [("bulk", mk.bulk)]
    async with redis.pipeline(transaction=False) as pipe:
        for _, stream in streams:
            pipe.xlen(stream)
            pipe.xinfo_groups(stream)
            pipe.zrange(keys.backlog(stream), 0, -1)
        answers = await pipe.execute(raise_on_error=False)
    # Requests staged for their tenant's turn (fair share) wait too: their count and oldest entry
    staged = [(lane, keys.staged(stream, t)) for i, (lane, stream) in enumerate(streams)
              for t in (answers[3 * i + 2] if isinstance(answers[3 * i + 2], list) else [])]
    async with redis.pipeline(transaction=False) as pipe:
        for _, key in staged:
            pipe.xlen(key)
            pipe.xrange(key, count=1)
        staged_answers = await pipe.execute(raise_on_error=False) if staged else []
    held: list[tuple[int, int, str | None]] = []  # per stream: entries, pending, last delivered id
    for i in range(len(streams)):
        length = answers[3 * i] if isinstance(answers[3 * i], int) else 0
        group = _group(answers[3 * i + 1])
        pending = int(group.get("pending") or 0) if group else 0
        held.append((length, min(pending, length), str(group["last-delivered-id"]) if group else None))
    # The first entry after the group's last-delivered id is the oldest that no worker has fetched.
    firsts = [i for i, (length, pending, _) in enumerate(held) if length > pending]
    async with redis.pipeline(transaction=False) as pipe:
        for i in firsts:
            last = held[i][2]
            pipe.xrange(streams[i][1], min=f"({last}" if last and last != "0-0" else "-", count=1)
        oldest_entries = await pipe.execute() if firsts else []
    now_ms = time.time() * 1000
    waiting = dict.fromkeys(LANES, 0)
    running = dict.fromkeys(LANES, 0)
    oldest = dict.fromkeys(LANES, now_ms)
    for (lane, _), (length, pending, _) in zip(streams, held):
        waiting[lane] += length - pending
        running[lane] += pending
    for i, entries in zip(firsts, oldest_entries):
        if entries:
            lane = streams[i][0]
            oldest[lane] = min(oldest[lane], _ms(entries[0][0]))
    for j, (lane, _) in enumerate(staged):
        length, first = staged_answers[2 * j], staged_answers[2 * j + 1]
        waiting[lane] += length if isinstance(length, int) else 0
        if isinstance(first, list) and first:
            oldest[lane] = min(oldest[lane], _ms(first[0][0]))
    return {lane: LaneFigures(waiting[lane], running[lane], max(now_ms - oldest[lane], 0.0) / 1000)
            for lane in LANES}
