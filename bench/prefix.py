"""`sluice bench prefix`: prefix affinity measured (issue 34).

`--sim` (the default) runs the placement simulator (bench/prefix_sim.py: 16 workers, 64 prefixes,
simulated LRU prefix caches, a prefill cost per uncached token) over one workload per line and
prints, per policy, the prefix-cache hit rate and its ratio to the oracle's, TTFT p50/p99,
throughput and the largest worker's share of the requests against the mean.

`--real` is the run on this machine's real engine (bench/prefix_real.py): two workers of the
default model with a KV cache too small for every prefix, the workload of `chat_workload` (8
shared system prompts of about 500 tokens, short user turns, Zipf), one fresh stack per mode
(`--mode off --mode on`): `off` is the deployment's `prefix_affinity: false` (FIFO pulls), `on`
the pull side of docs/prefix-affinity.md.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import typer

from sluice.bench.prefix_real import KV_GIB
from sluice.bench.prefix_sim import POLICIES, simulate
from sluice.bench.prefix_workload import SimConfig


def prefix(
    sim: bool = typer.Option(True, "--sim/--real", help="The placement simulator (default), or the real "
                                                        "engine on this machine."),
    requests: int = typer.Option(8000, help="Requests per simulated workload."),
    load: list[float] = typer.Option([0.8, 1.3], help="Arrival rate as a share of what the workers finish "
                                                      "when every prompt misses (repeat for several)."),
    zipf: list[float] = typer.Option([0.0, 1.0], help="Prefix popularity: 0 uniform, s > 0 Zipf (repeat)."),
    max_wait_ms: float = typer.Option(30.0, help="The bound on the extra wait affinity may add."),
    seed: int = typer.Option(0),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line instead of a table."),
    mode: list[str] = typer.Option(["off", "on"], help="--real: affinity off and/or on, one stack each."),
    real_requests: int = typer.Option(96, help="--real: chat requests per mode."),
    concurrency: int = typer.Option(4, help="--real: requests in flight at once."),
    max_tokens: int = typer.Option(16, help="--real: output tokens per request (ignore_eos)."),
    kv_gib: float = typer.Option(KV_GIB, help="--real: each worker's KV cache (cpu_kvcache_space_gib): "
                                              "15 blocks of 128 tokens in float32, 4 of the 8 system "
                                              "prompts beside a few running requests."),
    data_dir: Path | None = typer.Option(None, help="--real: keep the stacks' logs here."),
) -> None:
    """Prefix affinity: hit rate against an oracle, TTFT, throughput and worker shares per policy."""
    if not sim:
        from sluice.bench.prefix_real import run_mode

        for m in mode:
            if m not in ("off", "on"):
                raise typer.BadParameter("off or on", param_hint="--mode")
            zipf_real = zipf[-1] if zipf else 1.0
            figures = run_mode(m == "on", requests=real_requests, concurrency=concurrency,
                               max_tokens=max_tokens, kv_gib=kv_gib, zipf=zipf_real, seed=seed,
                               data_dir=data_dir / f"affinity-{m}" if data_dir else None)
            typer.echo(json.dumps(figures))
        return
    base = SimConfig(requests=requests, max_wait_s=max_wait_ms / 1000, seed=seed)
    for lo in load:
        for z in zipf:
            config = replace(base, load=lo, zipf=z)
            results = simulate(config, POLICIES)
            oracle = next(r.hit_rate for r in results if r.policy == "oracle")
            popularity = "uniform" if z == 0 else f"Zipf {z:g}"
            title = (f"{config.workers} workers x {config.slots} slots, {config.prefixes} prefixes of "
                     f"{config.prefix_tokens} tokens ({popularity}), load {lo:g}, "
                     f"cache {config.cache_blocks} blocks/worker, max wait {max_wait_ms:g} ms, seed {seed}")
            rows = [r.row(oracle) for r in results]
            if as_json:
                for row in rows:
                    typer.echo(json.dumps({"workload": title, **row}))
                continue
            typer.echo(title)
            typer.echo(_table(rows))
            typer.echo("")


def _table(rows: list[dict[str, float | str]]) -> str:
    head = list(rows[0])
    cells = [[str(r[k]) for k in head] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)
