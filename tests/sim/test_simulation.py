"""`make test`'s bounded run of the simulation (issue 28): fixed seeds, so a failure is a real
broken interleaving, printed as a minimal replay."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from sluice.broker.plumbing.connection import connect
from sluice.supervisor.processes import EmbeddedRedis
from tests.sim.harness import run_seeds
from tests.sim.run import play, replay_text

# 16 seeds: with each of the fixes for issue 28's defects 1, 2, 4, 6, 8 and 9 undone in turn, an
# invariant broke within them (one run: defect 1 at seed 7, step 42; 2 at seed 12 in the drain;
# 4 at seed 10, step 77; 6 at seed 10, step 102; 8 at seed 11, step 116; 9 at seed 2, step 100).
# Readers' timing makes runs differ a little: a seed may find a break in one run, not the next.
SEEDS = list(range(1, 17))
STEPS = 150
BUDGET_S = 75.0  # seeds are not started past this (a loaded 2-core machine runs fewer)
# Bugs the simulation found that are still open, by a phrase of their violation: reported as a
# warning, not a failure, until their fix lands (then the phrase goes).
KNOWN_OPEN: dict[str, str] = {}


async def test_no_interleaving_breaks_exactly_once() -> None:
    report = await run_seeds(SEEDS, STEPS, budget_s=BUDGET_S, shrink_budget=40, known=tuple(KNOWN_OPEN))
    assert report.seeds >= 1
    for failure in report.known:
        warnings.warn(f"a known open bug: {failure}", stacklevel=1)
    assert not report.failures, "\n\n".join(report.failures)


# Replays of bugs the simulation found (fixed): each must play to its end, drained, with no
# invariant broken.
FIXED = {
    "a first retry reclaimed beside a suspect is handed out (broker/delivery/quarantine.py)": [
        ("admit", 2, 1, False, False, 0), ("fetch", 0, 2), ("start", 0, 0), ("start", 0, 0), ("freeze", 0),
        ("fetch", 1, 1), ("start", 1, 0), ("freeze", 1), ("fetch", 2, 4)],
    "a write re-creating a lost reply stream gives it a TTL (broker/lua/reply.lua)": [
        ("admit", 1, 1, False, False, 0), ("fetch", 0, 1), ("start", 0, 0), ("snapshot",),
        ("emit", 0, 0, 0, 1), ("flush", 0), ("failover",), ("emit", 0, 0, 0, 1), ("flush", 0)],
    "a stale fetched entry never revives a cancelled, expired request (broker/lua/start.lua)": [
        ("admit", 2, 1, False, False, 3), ("fetch", 1, 2), ("cancel", 0), ("clock", 700)],
}


@pytest.mark.parametrize("name", list(FIXED))
async def test_a_fixed_bugs_replay_breaks_nothing(name: str, tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path, appendonly=False).start()
    redis = connect(server.url, name="sluice-sim")
    try:
        for seed in (1, 2):
            out = await play(redis, server.url, seed, replay=FIXED[name])
            assert out.violation is None, replay_text(seed, out)
    finally:
        await redis.aclose()
        server.stop()
