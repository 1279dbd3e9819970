"""`make test`'s bounded run of the simulation (issue 28): fixed seeds, so a failure is a real
broken interleaving, printed as a minimal replay."""

from __future__ import annotations

import warnings

from tests.sim.harness import run_seeds

SEEDS = list(range(1, 9))
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
