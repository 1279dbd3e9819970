"""`sluice bench simulate`: the exactly-once simulation of tests/sim run long (issue 28).

Seeds 1..N, each M steps of api, worker and reader actors against a private redis-server with
faults between steps; a failing seed is shrunk and printed as a minimal replay. The simulation
lives beside the tests (tests/sim): run it from a checkout of the repository."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import typer


def simulate(
    seeds: int = typer.Option(20, "--seeds", help="Seeds to run (1..N)."),
    steps: int = typer.Option(300, "--steps", help="Steps drawn per seed (then every actor is drained)."),
    first: int = typer.Option(1, "--first", help="The first seed."),
    faults: str = typer.Option("crash,freeze,lose,dup,failover,clock,poison,restart", "--faults",
                               help="Fault kinds to inject (comma-separated; empty: none)."),
    shrink: int = typer.Option(150, "--shrink", help="Replays at most spent shrinking a failing seed."),
) -> None:
    """Hunt for interleavings that break exactly-once delivery; exit 1 if one is found."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "tests" / "sim").is_dir():
        raise typer.BadParameter("tests/sim is not beside this installation: run it from a checkout")
    sys.path.insert(0, str(root))
    from tests.sim.harness import run_seeds

    chosen = tuple(f for f in faults.split(",") if f)
    began = time.monotonic()
    report = asyncio.run(run_seeds(list(range(first, first + seeds)), steps, faults=chosen,
                                   shrink_budget=shrink, say=typer.echo))
    typer.echo(f"{report.seeds} seeds, {report.steps} steps ({', '.join(chosen) or 'no faults'}): "
               f"{len(report.failures)} broke an invariant, in {time.monotonic() - began:.0f} s")
    if report.failures:
        raise typer.Exit(1)
