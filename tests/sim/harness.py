"""Running seeds against a private redis-server: the pytest entry and `sluice bench simulate`."""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sluice.broker.plumbing.connection import connect
from sluice.supervisor.processes import EmbeddedRedis
from tests.sim.run import ALL_FAULTS, Outcome, play, replay_text, shrink

SEED_TIMEOUT_S = 300.0  # a seed takes seconds; this is a hang


@dataclass
class Report:
    seeds: int = 0
    steps: int = 0
    failures: list[str] = field(default_factory=list)
    known: list[str] = field(default_factory=list)  # failures of a bug still open (`known`): not shrunk
    first_failure_steps: list[int] = field(default_factory=list)  # steps drawn before each broke


async def run_seeds(seeds: list[int], steps: int, *, faults: tuple[str, ...] = ALL_FAULTS,
                    budget_s: float | None = None, shrink_budget: int = 150, known: tuple[str, ...] = (),
                    say: Callable[[str], None] = print, data_dir: Path | None = None) -> Report:
    """Each seed against one redis-server (flushed between runs); a failing seed is shrunk and
    its replay reported. Stops starting seeds once `budget_s` has passed."""
    report = Report()
    began = time.monotonic()
    quiet = logging.getLogger("sluice")
    level, quiet.level = quiet.level, logging.CRITICAL  # the faults make the broker complain, as they should
    with tempfile.TemporaryDirectory() as tmp:
        # its own server, with an AOF in the default durability (the restart fault)
        server = EmbeddedRedis(data_dir or Path(tmp), appendonly=True).start()
        redis = connect(server.url, name="sluice-sim")
        try:
            for seed in seeds:
                if budget_s is not None and report.seeds and time.monotonic() - began > budget_s:
                    break
                try:
                    out: Outcome = await asyncio.wait_for(
                        play(redis, server.url, seed, steps=steps, faults=faults, server=server), SEED_TIMEOUT_S)
                except TimeoutError:  # a broker call that never answers, or a drain that never ends
                    report.seeds += 1
                    report.failures.append(f"seed {seed}: no end after {SEED_TIMEOUT_S:g} s")
                    say(report.failures[-1])
                    continue
                report.seeds += 1
                report.steps += len(out.steps)
                if out.violation is None:
                    continue
                report.first_failure_steps.append(len(out.steps) if out.at is None else out.at + 1)
                if any(sign in str(out.violation) for sign in known):
                    report.known.append(f"seed {seed}, step {report.first_failure_steps[-1]}: {out.violation}")
                    continue
                small = await shrink(redis, server.url, seed, out, budget=shrink_budget, faults=faults, server=server)
                text = replay_text(seed, small)
                report.failures.append(text)
                say(text)
        finally:
            await redis.aclose()
            server.stop()
            quiet.setLevel(level)
    return report
