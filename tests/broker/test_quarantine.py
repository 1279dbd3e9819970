"""The quarantine's groups (broker/quarantine.py): bisection over the suspects a worker holds."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.broker.quarantine import Quarantine, group_cap


@dataclass(eq=False)
class Suspect:
    n: int
    group: int = 0
    isolated: bool = True


def test_each_crash_halves_the_group() -> None:
    assert [group_cap(g) for g in (0, 1, 2, 3, 8, 9)] == [0, 1, 1, 1, 4, 4]


def test_the_first_group_is_half_the_suspects_then_the_smallest_cap_goes_first() -> None:
    q = Quarantine()
    unknown = [Suspect(i) for i in range(5)]
    q.parked.extend(unknown)
    first = q.next_group(64)
    assert [s.n for s in first] == [0, 1, 2] and all(s.group == 3 for s in first)  # ceil(5 / 2)
    q.parked.append(Suspect(9, group=1))  # crashed in a group of two: runs alone next
    assert [s.n for s in q.next_group(64)] == [9]
    assert [s.n for s in q.next_group(1)] == [3]  # never more than the room
    assert [s.n for s in q.next_group(64)] == [4]
    assert q.next_group(64) == []


def test_sort_hands_out_a_group_or_ordinary_work_never_both() -> None:
    q = Quarantine()
    retried = Suspect(1, isolated=False)  # a first retry: ordinary work
    suspect = Suspect(2)
    assert q.sort([retried, suspect], 8, 0) == [retried]  # a group runs already: the suspect waits
    assert q.parked == [suspect]
    assert q.sort([], 8, 8) == [suspect]
    assert q.sort([], 8, 8) is None  # nothing held: read new entries
