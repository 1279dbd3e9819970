"""`sluice bench ...`: every benchmark registered here, by name (no import side effects)."""

from __future__ import annotations

import os
from collections.abc import Callable

import typer

from sluice.bench import (
    chaos,
    durability,
    fairness,
    hostile,
    prefix,
    queue,
    serve,
    simulate,
    soak,
    streams,
    throughput,
    tokens,
    webhooks,
)

bench_app = typer.Typer(no_args_is_help=True, help="Measure Sluice against a baseline in the same run.",
                        callback=lambda: os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING"))

COMMANDS: dict[str, Callable[..., None]] = {
    "throughput": throughput.throughput,
    "startup": throughput.startup,
    "modes": throughput.modes,
    "bulk": throughput.bulk,
    "serve": serve.serve,
    "queue": queue.queue,
    "scale": queue.scale,
    "streams": streams.streams,
    "tokens": tokens.tokens,
    "chaos": chaos.chaos,
    "durability": durability.durability,
    "soak": soak.soak_command,
    "simulate": simulate.simulate,
    "hostile": hostile.hostile,
    "webhooks": webhooks.webhooks,
    "prefix": prefix.prefix,
    "fairness": fairness.fairness,
}
for name, command in COMMANDS.items():
    bench_app.command(name)(command)
