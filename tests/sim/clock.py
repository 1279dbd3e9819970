"""The simulation's clock: the broker modules read time through it, so that deadlines pass and
reclaim scans come due when the scheduler says, not when the machine's clock does."""

from __future__ import annotations

import contextlib
import importlib
import time as real_time
from collections.abc import Iterator

# Modules whose `time.time()` / `time.monotonic()` the simulation owns while it runs.
PATCHED = ("sluice.broker.delivery.consumer", "sluice.broker.intake.cancels", "sluice.broker.delivery.dead_letters",
           "sluice.workers.generation")


class SimClock:
    """`time()`: a fixed start plus the simulated seconds; `monotonic()`: moves 10 s per step
    (a worker's reclaim scan rests at most 1 s, so every fetch scans again)."""

    def __init__(self) -> None:
        self.start = real_time.time()
        self.elapsed = 0.0  # simulated seconds (clock faults, and 1 ms per step)
        self.steps = 0

    def time(self) -> float:
        return self.start + self.elapsed

    def monotonic(self) -> float:
        return self.elapsed + 10.0 * self.steps

    def tick(self) -> None:
        self.steps += 1
        self.elapsed += 0.001

    def __getattr__(self, name: str) -> object:  # sleep, perf_counter ...: the real ones
        return getattr(real_time, name)


@contextlib.contextmanager
def installed(clock: SimClock) -> Iterator[SimClock]:
    modules = [importlib.import_module(name) for name in PATCHED]
    saved = [m.time for m in modules]
    for m in modules:
        m.time = clock
    try:
        yield clock
    finally:
        for m, t in zip(modules, saved):
            m.time = t
