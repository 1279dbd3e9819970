"""Holding a worker's engine concurrency where the time per output token meets its target.

On a saturated engine, each request's time per output token (TPOT) grows with the number of
requests decoding beside it. Serving more at once than the target allows makes every one of
them late; a queue can do better by keeping the rest waiting (or refused at the door, see
the api's admission) while those admitted run on time.

`ConcurrencyGovernor` sees time-per-token samples with the concurrency they ran at (the worker
feeds it the gap before each token, so it acts within an engine step or two of a burst, long
before the burst's first request finishes). After every `window` of them it compares the
window's quantile (p90 by default; the worker uses the median of its token gaps, the mean
TPOT a request sees) with the target: above it, the limit
drops to the concurrency the target allows if TPOT is proportional to concurrency (at most
halving in one step); well below it while the limit was reached, the limit grows by an
eighth (at least one). Pure logic: the worker feeds it and applies `limit`.
"""

from __future__ import annotations

import math


class ConcurrencyGovernor:
    def __init__(self, target_tpot_s: float, capacity: int, *, window: int = 8, floor: int = 1,
                 start: int | None = None, quantile: float = 0.9):
        self.target = target_tpot_s
        self.capacity = capacity
        self.window = window
        self.quantile = quantile  # of the window's samples, compared with the target
        self.floor = max(1, min(floor, capacity))
        self.limit = max(self.floor, min(start or capacity, capacity))
        self._samples: list[tuple[float, int]] = []

    def observe(self, tpot_s: float, concurrency: int) -> int:
        """One finished request: its TPOT and how many ran beside it (itself included).
        Returns the limit, changed after every `window` observations."""
        self._samples.append((tpot_s, max(concurrency, 1)))
        if len(self._samples) >= self.window:
            self._adjust()
        return self.limit

    def _adjust(self) -> None:
        tpots = sorted(t for t, _ in self._samples)
        p90 = tpots[min(len(tpots) - 1, max(math.ceil(self.quantile * len(tpots)) - 1, 0))]
        ran_at = sum(c for _, c in self._samples) / len(self._samples)
        reached = max(c for _, c in self._samples) >= self.limit
        self._samples.clear()
        if p90 > self.target:
            allowed = math.floor(ran_at * self.target / p90)
            self.limit = max(self.floor, self.limit // 2, min(allowed, self.limit - 1))
        elif p90 < 0.8 * self.target and reached:
            self.limit = min(self.capacity, self.limit + max(1, self.limit // 8))
