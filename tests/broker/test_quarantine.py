"""The quarantine's groups (broker/delivery/quarantine.py): bisection over the suspects a worker holds."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from redis.asyncio import Redis

from sluice.broker.delivery.quarantine import Quarantine, group_cap
from sluice.config.settings import Settings
from tests.broker.helpers import admission, ready_consumer, submit_n
from tests.broker.test_exactly_once import expire_lease


@dataclass(eq=False)
class Suspect:
    n: int
    group: int = 0
    quarantined: bool = True


def test_each_crash_halves_the_group() -> None:
    assert [group_cap(g) for g in (0, 1, 2, 3, 8, 9)] == [0, 1, 1, 1, 4, 4]


def test_the_first_group_is_half_the_suspects_then_the_smallest_cap_goes_first() -> None:
    q = Quarantine()
    unknown = [Suspect(i) for i in range(5)]
    q.parked.extend(unknown)
    first = q.next_group(64)
    assert [s.n for s in first] == [0, 1, 2] and all(s.group == 3 for s in first)  # ceil(5 / 2)
    q.parked.append(Suspect(9, group=1))  # crashed in a group of two: runs in a group of one next
    assert [s.n for s in q.next_group(64)] == [9]
    assert [s.n for s in q.next_group(1)] == [3]  # never more than the room
    assert [s.n for s in q.next_group(64)] == [4]
    assert q.next_group(64) == []


def test_sort_parks_a_suspect_until_a_group_may_run() -> None:
    q = Quarantine()
    retried = Suspect(1, quarantined=False)  # a first retry: ordinary work
    suspect = Suspect(2)
    assert q.sort([retried, suspect], 8, 0) == [retried]  # a group runs already: the suspect waits
    assert q.parked == [suspect]
    assert q.sort([], 8, 8) == [suspect]
    assert q.sort([], 8, 8) is None  # nothing held: read new entries


@pytest.mark.parametrize("seed", range(200))
def test_sort_never_holds_back_ordinary_work_nor_hands_out_a_suspect_twice(seed: int) -> None:
    """Any sequence of fetches (what each reclaimed, its count, its room for a group): every
    ordinary redelivery goes out in the fetch that reclaimed it, every suspect goes out once or
    is still parked, a group never past the room, and never more than `count` at once.
    (Suspects and first retries reclaimed at once, with room for a group, once dropped the
    first retries: held and leased forever, never run.)"""
    rng = random.Random(seed)
    q = Quarantine()
    out: list[Suspect] = []
    made = 0
    for _ in range(12):
        count, quarantine_room = rng.randint(0, 6), rng.choice([0, 0, 1, 2, 8])
        room = count - len(q.parked)
        got = []
        for _ in range(rng.randint(0, max(room, 0))):
            made += 1
            got.append(Suspect(made, quarantined=rng.random() < 0.5))
        handed = q.sort(got, count, quarantine_room) or []
        assert [d for d in got if not d.quarantined] == [d for d in handed if not d.quarantined]
        assert len(handed) <= max(count, 0)
        assert sum(d.quarantined for d in handed) <= quarantine_room
        out += handed
    assert sorted(d.n for d in out + q.parked) == list(range(1, made + 1))  # each exactly once


async def test_a_fetch_reclaiming_a_suspect_and_a_first_retry_hands_out_both(
        redis: Redis, settings: Settings) -> None:
    """The simulation's replay: two requests run on w0, whose lease lapses; w1 takes one over
    and its lease lapses too; w2 reclaims both at once, a suspect (attempt 3) and a first retry
    (attempt 2), with room for a group. Both are handed out: nothing w2 holds is left unrun."""
    adm = admission(redis, settings)
    sent = await submit_n(adm, 2)
    w0 = await ready_consumer(redis, settings, "w0")
    for d in await w0.fetch(2, 100):
        assert await w0.start(d) == "run"
        await expire_lease(redis, d, "w0")
    w1 = await ready_consumer(redis, settings, "w1")
    (retried,) = await w1.fetch(1, 100)
    assert await w1.start(retried) == "run"
    await expire_lease(redis, retried, "w1")
    w2 = await ready_consumer(redis, settings, "w2")
    got = await w2.fetch(4, 100, quarantine_room=4)
    assert sorted((d.attempt, d.quarantined) for d in got) == [(2, False), (3, True)]
    assert {d.message.id for d in got} == {m.id for m in sent}
    assert set(w2.held) == {d.key for d in got}  # everything it holds is in its hands
    for d in got:
        assert await w2.start(d) == "run"
