"""`sluice bench serve`: latency and throughput under load, Sluice against AsyncLLMEngine in
this process (and any OpenAI-style URL), at several load levels, as a table, JSON and a PNG."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from sluice.bench.frontend_cpu import Sample, per_level, sampler
from sluice.bench.loadgen import (
    Send,
    close,
    drive,
    engine_sender,
    make_requests,
    openai_sender,
    sluice_sender,
    summarize,
)
from sluice.bench.throughput import direct_engine, local_stack
from sluice.config.model import load_models
from sluice.config.settings import Settings
from sluice.supervisor.stack import LocalStack


def _pair(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return int(lo), int(hi or lo)


def _levels(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


@dataclass(frozen=True)
class Load:
    """The load levels every target is measured at, and the requests of each level."""

    levels: list[float]
    by: str  # "concurrency" (a level caps the requests at once) or "rate" (requests per second)
    requests: int  # per level
    prompt_words: tuple[int, int]
    output_tokens: tuple[int, int]
    seed: int
    poisson: bool
    slo: tuple[float, float]  # goodput's (TTFT, TPOT) in seconds


async def _levels_run(send: Send, load: Load, cpu: Sample | None = None) -> list[dict]:
    """Each level's figures; with `cpu`, also its frontend processes' CPU (bench/frontend_cpu.py)."""
    by, seed = load.by, load.seed
    results = []
    try:
        await drive(send, make_requests(2, (4, 4), (4, 4), seed + 99), rate=None, poisson=False,
                    concurrency=2, seed=seed)
        for level in load.levels:
            requests = make_requests(load.requests, load.prompt_words, load.output_tokens, seed)
            before = cpu() if cpu else {}
            records, wall = await drive(send, requests, rate=level if by == "rate" else None,
                                        poisson=load.poisson,
                                        concurrency=int(level) if by == "concurrency" else None, seed=seed)
            figures = summarize(records, wall, slo_ttft_s=load.slo[0], slo_tpot_s=load.slo[1])
            results.append({by: level, **figures})
            if cpu:
                tokens = results[-1]["output_token_throughput"] * wall
                results[-1]["frontend"] = per_level(before, cpu(), tokens)
    finally:
        await close(send)
    return results


def _vllm_levels(settings: Settings, model: str | None, name: str, load: Load) -> list[dict]:
    """The same load against `vllm serve` with the deployment's engine options (its own port and
    process; nothing of Sluice runs meanwhile)."""
    import tempfile

    from sluice.bench.vllm_server import vllm_serve
    from sluice.supervisor.processes import free_port
    from sluice.workers.engines.vllm import engine_args
    from sluice.workers.model_prep import resolve_model_path

    models = load_models(settings.models_file)
    m = next((x for x in models if x.name == model), models[0])
    kwargs, _ = engine_args(resolve_model_path(m.path, settings.cache_dir), m.framework_config)
    log = Path(tempfile.gettempdir()) / f"sluice-bench-vllm-serve-{os.getpid()}.log"
    pids: dict[str, int] = {}
    with vllm_serve(kwargs.pop("model"), kwargs, served_name=name, port=free_port(), log=log,
                    on_start=lambda pid: pids.setdefault("vllm api server", pid)) as url:
        return asyncio.run(_levels_run(openai_sender(url, name), load, cpu=sampler(pids)))


def _ratios(by: str, ours: list[dict], theirs: list[dict]) -> list[dict]:
    def delta(metric: str, p: str) -> float | None:
        a, b = s[metric][p], t[metric][p]
        return None if a is None or b is None else a - b

    out = []
    for s, t in zip(ours, theirs):
        cpu = {}
        # Sluice's api, worker and Redis against vLLM's api server
        if "frontend" in s and "frontend" in t:
            cpu = {"frontend_cpu_ratio": s["frontend"]["cpu_ms_per_1000_tokens"]
                   / max(t["frontend"]["cpu_ms_per_1000_tokens"], 1e-9)}
        out.append({by: s[by],
                    "throughput_ratio": s["output_token_throughput"] / t["output_token_throughput"], **cpu,
                    "goodput": [s["goodput"], t["goodput"]],
                    **{f"added_{m}_{p}_s": delta(m, p)
                       for m in ("ttft", "tpot", "itl", "e2e") for p in ("p50", "p99")}})
    return out


async def _engine_levels(settings: Settings, model: str | None, load: Load) -> list[dict]:
    _, engine = direct_engine(settings, model)
    try:
        return await _levels_run(engine_sender(engine), load)
    finally:
        engine.shutdown()


def _parts(frontend: dict) -> str:
    return ", ".join(f"{name} {sec:.1f} s" for name, sec in frontend["cpu_s"].items())


def _fmt(x: float | None, scale: float = 1.0) -> str:
    return "-" if x is None else f"{x * scale:.0f}" if scale != 1.0 else f"{x:.2f}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:+.0f} ms"


def _table(title: str, by: str, runs: dict[str, list[dict]]) -> Table:
    table = Table(title=title)
    for col in ("target", by, "req/s", "out tok/s", "goodput", "TTFT p50/p99 ms", "TPOT p50 ms",
                "ITL p50 ms", "queue p50 ms", "e2e p50/p99 s"):
        table.add_column(col)
    for target, results in runs.items():
        for r in results:
            table.add_row(target, f"{r[by]:g}", f"{r['request_throughput']:.2f}",
                          f"{r['output_token_throughput']:.0f}", f"{r['goodput']:.2f}",
                          f"{_fmt(r['ttft']['p50'], 1e3)}/{_fmt(r['ttft']['p99'], 1e3)}",
                          _fmt(r["tpot"]["p50"], 1e3), _fmt(r["itl"]["p50"], 1e3),
                          _fmt(r["queue_wait"]["p50"], 1e3),
                          f"{_fmt(r['e2e']['p50'])}/{_fmt(r['e2e']['p99'])}")
    return table


def _plot(path: Path, by: str, runs: dict[str, list[dict]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for target, results in runs.items():
        xs = [r["output_token_throughput"] for r in results]
        axes[0].plot(xs, [r["ttft"]["p50"] for r in results], marker="o", label=f"{target} TTFT p50")
        axes[0].plot(xs, [r["ttft"]["p99"] for r in results], marker="x", linestyle="--",
                     label=f"{target} TTFT p99")
        axes[1].plot(xs, [r["e2e"]["p50"] for r in results], marker="o", label=f"{target} e2e p50")
        axes[1].plot(xs, [r["e2e"]["p99"] for r in results], marker="x", linestyle="--",
                     label=f"{target} e2e p99")
    for ax, name in zip(axes, ("time to first token (s)", "end-to-end latency (s)")):
        ax.set_xlabel(f"output tokens/s (load: {by})")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def serve(
    target: str = typer.Option("compare",
                               help="sluice, engine, openai, or compare (sluice and engine)."),
    against: str = typer.Option(None, help="vllm: the same load against `vllm serve` with the "
                                           "deployment's engine options, then against Sluice's OpenAI "
                                           "route, one at a time."),
    url: str = typer.Option(None,
                            help="A running Sluice api or OpenAI-style server (else a local stack)."),
    model: str = typer.Option(None, help="Model name (default: the first in the models file)."),
    concurrency: str = typer.Option("1,8,32", help="Load levels as concurrency caps (comma-separated)."),
    rate: str = typer.Option(None, help="Load levels as request rates per second instead."),
    poisson: bool = typer.Option(True, "--poisson/--fixed-rate", help="Arrivals with --rate."),
    requests: int = typer.Option(64, help="Requests per load level."),
    prompt_words: str = typer.Option("8,64", help="Prompt length range in words."),
    output_tokens: str = typer.Option("16,128", help="max_tokens range."),
    slo_ttft: float = typer.Option(2.0, help="Goodput SLO: time to first token (s)."),
    slo_tpot: float = typer.Option(0.2, help="Goodput SLO: time per output token (s)."),
    seed: int = typer.Option(0),
    api_key: str = typer.Option(None, envvar="SLUICE_API_KEY"),
    out: Path = typer.Option(None, help="Write the figures as JSON here."),
    plot: Path = typer.Option(None, help="Write a PNG of latency against load here."),
    repeat: int = typer.Option(1, help="With --against vllm: measure both sides this many times, "
                                       "alternating which goes first, and report each level's median "
                                       "ratio (a shared machine's speed drifts between runs more than "
                                       "the gap measured)."),
) -> None:
    """Load generator in the style of `vllm bench serve`."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    settings = Settings()
    name = model or load_models(settings.models_file)[0].name
    by, levels = ("rate", _levels(rate)) if rate else ("concurrency", _levels(concurrency))
    load = Load(levels, by, requests, _pair(prompt_words), _pair(output_tokens), seed, poisson,
                (slo_ttft, slo_tpot))
    targets = ["engine", "sluice"] if target == "compare" else [target]
    if against == "vllm":
        targets = ["vllm", "sluice-openai"]
    elif against is not None:
        raise typer.BadParameter("--against takes vllm")
    repeats = [_targets(targets if r % 2 == 0 else targets[::-1], settings, model, name, url, api_key, load)
               for r in range(max(1, repeat) if against else 1)]
    runs = repeats[0]
    figures: dict = {"by": by, "requests_per_level": requests, "ignore_eos": True, "runs": runs}
    baseline = "vllm" if "vllm" in runs else "engine"
    if baseline in runs and "sluice" in runs:
        figures[f"sluice_vs_{baseline}"] = _ratios(by, runs["sluice"], runs[baseline])
    console = Console(width=170)
    console.print(_table(f"{requests} requests per level, prompts {prompt_words} words, "
                         f"max_tokens {output_tokens}", by, runs))
    for row in figures.get(f"sluice_vs_{baseline}", []):
        if "frontend_cpu_ratio" in row:
            i = levels.index(row[by])
            ours, theirs = runs["sluice"][i]["frontend"], runs[baseline][i]["frontend"]
            console.print(f"{by} {row[by]:g}: frontend CPU per 1,000 output tokens: Sluice "
                          f"{ours['cpu_ms_per_1000_tokens']:.0f} ms ({_parts(ours)}), vLLM's api server "
                          f"{theirs['cpu_ms_per_1000_tokens']:.0f} ms: "
                          f"ratio {row['frontend_cpu_ratio']:.2f}")
        added = ", ".join(f"{m.upper()} p50 {_ms(row[f'added_{m}_p50_s'])} p99 {_ms(row[f'added_{m}_p99_s'])}"
                          for m in ("ttft", "tpot", "e2e"))
        console.print(f"{by} {row[by]:g} against {baseline}: throughput ratio {row['throughput_ratio']:.3f}, "
                      f"goodput {row['goodput'][0]:.2f} vs {row['goodput'][1]:.2f} req/s; added {added}")
    if len(repeats) > 1:
        figures["repeats"] = [{"runs": r, "sluice_vs_vllm": _ratios(by, r["sluice"], r["vllm"])}
                              for r in repeats]
        figures["median_throughput_ratio"] = {}
        for i, level in enumerate(levels):
            ratios = [r["sluice_vs_vllm"][i]["throughput_ratio"] for r in figures["repeats"]]
            figures["median_throughput_ratio"][f"{level:g}"] = statistics.median(ratios)
            console.print(f"{by} {level:g}: throughput ratio per run "
                          f"{', '.join(f'{x:.3f}' for x in ratios)}; median {statistics.median(ratios):.3f}")
            cpu = [r["sluice_vs_vllm"][i].get("frontend_cpu_ratio") for r in figures["repeats"]]
            if None not in cpu:
                figures.setdefault("median_frontend_cpu_ratio", {})[f"{level:g}"] = statistics.median(cpu)
                console.print(f"{by} {level:g}: frontend CPU ratio per run "
                              f"{', '.join(f'{x:.2f}' for x in cpu)}; median {statistics.median(cpu):.2f}")
    if out:
        out.write_text(json.dumps(figures, indent=2))
    if plot:
        _plot(plot, by, runs)


def _targets(targets: list[str], settings: Settings, model: str | None, name: str, url: str | None,
             api_key: str | None, load: Load) -> dict[str, list[dict]]:
    """One measurement of each target, in this order."""
    runs: dict[str, list[dict]] = {}
    for t in targets:
        if t == "vllm":
            runs["vllm"] = _vllm_levels(settings, model, name, load)
        elif t == "sluice-openai":
            with tempfile.TemporaryDirectory() as tmp, LocalStack(Path(tmp)) as stack:
                stack.up([name], timeout_s=900)
                redis = stack.redis.process if stack.redis else None
                assert redis is not None  # up() started a local Redis
                cpu = sampler({"api": next(iter(stack.apis.values())).pid,
                               # (the worker's own process: not its engine core)
                               "worker": next(iter(stack.workers.values())).pid,
                               "redis": redis.pid})
                runs["sluice"] = asyncio.run(_levels_run(openai_sender(stack.url, name), load, cpu=cpu))
        elif t == "engine":
            runs["engine"] = asyncio.run(_engine_levels(settings, model, load))
        elif t == "openai":
            if not url:
                raise typer.BadParameter("--url is needed with --target openai")
            runs["openai"] = asyncio.run(_levels_run(openai_sender(url, name, api_key), load))
        elif url:
            runs["sluice"] = asyncio.run(_levels_run(sluice_sender(url, model), load))
        else:
            with local_stack(name) as local:
                runs["sluice"] = asyncio.run(_levels_run(sluice_sender(local, model), load))
    return runs
