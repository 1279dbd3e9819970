"""`make test`'s bounded run of the simulation (issue 28): fixed seeds, so a failure is a real
broken interleaving, printed as a minimal replay."""

from __future__ import annotations

from tests.sim.harness import run_seeds

SEEDS = list(range(1, 9))
STEPS = 150
BUDGET_S = 75.0  # seeds are not started past this (a loaded 2-core machine runs fewer)


async def test_no_interleaving_breaks_exactly_once() -> None:
    report = await run_seeds(SEEDS, STEPS, budget_s=BUDGET_S, shrink_budget=60)
    assert report.seeds >= 1
    assert not report.failures, "\n\n".join(report.failures)
