"""Retries without a throughput cliff: a crashed batch is retried together first, and split
only when it crashes again (DESIGN.md, delivery step 7).

- A request's first redelivery (attempt 2) runs as fresh work, beside anything: most crashes (a
  worker killed, its machine lost) take healthy requests down, and they all finish on that
  retry. A crash beside healthy requests costs each of them one extra run, not one run each
  in turn.
- A request redelivered again (attempt 3 on: it was in two runs that crashed) is a suspect: it
  runs in quarantine, in a group of suspects, one group at a time per worker (in dynamic and
  single mode a batch of its own, alone in the engine; in continuous mode beside fresh
  requests: draining an engine of hundreds of requests for each suspect would be the cliff
  again). Each crash halves the group its members may run in (the group's size is kept on
  their status, `group`), the first group being half of the suspects waiting: bisection, so a
  poison request among n is in a group of one after about log2(n) crashes.
- Only a crash in a group of one is charged (start.lua's `charges`): past N charges the request
  is dead-lettered, and no suspect is charged for another suspect.
"""

from __future__ import annotations

import math
from typing import Protocol

from redis.asyncio import Redis

SUSPECT_ATTEMPT = 3  # the attempt from which a redelivered request runs in quarantine


class Held(Protocol):
    group: int  # while parked: the largest group it may run in (0: not known); handed out: its group's size

    @property
    def quarantined(self) -> bool: ...


def group_cap(last_group: int | None) -> int:
    """The largest group a suspect may run in: half the group it last crashed in (0: not known)."""
    return max(1, last_group // 2) if last_group else 0


async def history(redis: Redis, stream: str, group: str, entry_id: str, status: str) -> tuple[int, int, int]:
    """A redelivered entry's delivery count, how many of its runs in a group of one crashed (its charges), and
    the size of the last quarantine group it ran in (0: none yet)."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.xpending_range(stream, group, entry_id, entry_id, 1)
        pipe.hmget(status, "charges", "group")
        info, (charges, last) = await pipe.execute()
    return (int(info[0]["times_delivered"]) if info else 1), int(charges or 0), int(last or 0)


class Quarantine:
    """The suspects a worker holds (leased) until its policy may run a quarantine group (none
    of its own is running), handed out a group at a time."""

    def __init__(self) -> None:
        self.parked: list[Held] = []

    def sort(self, redelivered: list, count: int, quarantine_room: int) -> list | None:
        """What a fetch of `count` hands out of what it reclaimed (held): the suspects are parked,
        the rest goes at once (never held back: whatever is not parked is handed out now), and
        a quarantine group (at most `quarantine_room`, within what is left of `count`) goes with it when
        the caller may run one. None: nothing from here, read new entries."""
        self.parked.extend(d for d in redelivered if d.quarantined)
        fresh = [d for d in redelivered if not d.quarantined]
        if self.parked and quarantine_room > 0:
            return fresh + self.next_group(min(count - len(fresh), quarantine_room))
        return fresh if fresh or count <= 0 else None

    def drop(self, held: Held) -> None:
        """A parked suspect this worker lost (another took it over)."""
        self.parked = [d for d in self.parked if d is not held]

    def next_group(self, room: int) -> list[Held]:
        """The next group, at most `room`: the suspects with the smallest cap first (a known cap
        before an unknown one: half of those parked without one)."""
        if not self.parked or room <= 0:
            return []
        self.parked.sort(key=lambda d: d.group or math.inf)
        unknown = sum(1 for d in self.parked if not d.group)
        size = min(self.parked[0].group or max(1, math.ceil(unknown / 2)), room)
        group, self.parked = self.parked[:size], self.parked[size:]
        for d in group:
            d.group = len(group)
        return group
