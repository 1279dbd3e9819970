"""`sluice bench serve`: latency and throughput under load, Sluice against AsyncLLMEngine in
this process (and any OpenAI-style URL), at several load levels, as a table, JSON and a PNG."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from sluice.bench.loadgen import drive, engine_sender, make_requests, openai_sender, sluice_sender, summarize
from sluice.bench.throughput import direct_engine, local_stack
from sluice.config.model import load_models
from sluice.config.settings import Settings


def _pair(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return int(lo), int(hi or lo)


def _levels(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


async def _levels_run(send, levels: list[float], by: str, n: int, words, outputs, seed: int, poisson: bool,
                      slo: tuple[float, float]) -> list[dict]:
    results = []
    await drive(send, make_requests(2, (4, 4), (4, 4), seed + 99), rate=None, poisson=False, concurrency=2, seed=seed)
    for level in levels:
        requests = make_requests(n, words, outputs, seed)
        records, wall = await drive(send, requests, rate=level if by == "rate" else None, poisson=poisson,
                                    concurrency=int(level) if by == "concurrency" else None, seed=seed)
        results.append({by: level, **summarize(records, wall, slo_ttft_s=slo[0], slo_tpot_s=slo[1])})
    return results


async def _engine_levels(settings: Settings, model: str | None, *args) -> list[dict]:
    _, engine = direct_engine(settings, model)
    try:
        return await _levels_run(engine_sender(engine), *args)
    finally:
        engine.shutdown()


def _fmt(x: float | None, scale: float = 1.0) -> str:
    return "-" if x is None else f"{x * scale:.0f}" if scale != 1.0 else f"{x:.2f}"


def _table(title: str, by: str, runs: dict[str, list[dict]]) -> Table:
    table = Table(title=title)
    for col in ("target", by, "req/s", "out tok/s", "goodput", "TTFT p50/p99 ms", "TPOT p50 ms", "ITL p50 ms",
                "queue p50 ms", "e2e p50/p99 s"):
        table.add_column(col)
    for target, results in runs.items():
        for r in results:
            table.add_row(target, f"{r[by]:g}", f"{r['request_throughput']:.2f}", f"{r['output_token_throughput']:.0f}",
                          f"{r['goodput']:.2f}", f"{_fmt(r['ttft']['p50'], 1e3)}/{_fmt(r['ttft']['p99'], 1e3)}",
                          _fmt(r["tpot"]["p50"], 1e3), _fmt(r["itl"]["p50"], 1e3), _fmt(r["queue_wait"]["p50"], 1e3),
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
        axes[0].plot(xs, [r["ttft"]["p99"] for r in results], marker="x", linestyle="--", label=f"{target} TTFT p99")
        axes[1].plot(xs, [r["e2e"]["p50"] for r in results], marker="o", label=f"{target} e2e p50")
        axes[1].plot(xs, [r["e2e"]["p99"] for r in results], marker="x", linestyle="--", label=f"{target} e2e p99")
    for ax, name in zip(axes, ("time to first token (s)", "end-to-end latency (s)")):
        ax.set_xlabel(f"output tokens/s (load: {by})")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def serve(
    target: str = typer.Option("compare", help="sluice, engine, openai, or compare (sluice and engine)."),
    url: str = typer.Option(None, help="A running Sluice api or OpenAI-style server (else a local stack)."),
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
) -> None:
    """Load generator in the style of `vllm bench serve`."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    settings = Settings()
    name = model or load_models(settings.models_file)[0].name
    by, levels = ("rate", _levels(rate)) if rate else ("concurrency", _levels(concurrency))
    args = (levels, by, requests, _pair(prompt_words), _pair(output_tokens), seed, poisson, (slo_ttft, slo_tpot))
    runs: dict[str, list[dict]] = {}
    targets = ["engine", "sluice"] if target == "compare" else [target]
    for t in targets:
        if t == "engine":
            runs["engine"] = asyncio.run(_engine_levels(settings, model, *args))
        elif t == "openai":
            if not url:
                raise typer.BadParameter("--url is needed with --target openai")
            runs["openai"] = asyncio.run(_levels_run(openai_sender(url, name, api_key), *args))
        elif url:
            runs["sluice"] = asyncio.run(_levels_run(sluice_sender(url, model), *args))
        else:
            with local_stack(name) as local:
                runs["sluice"] = asyncio.run(_levels_run(sluice_sender(local, model), *args))
    figures: dict = {"by": by, "requests_per_level": requests, "runs": runs}
    if "engine" in runs and "sluice" in runs:
        figures["sluice_vs_engine"] = [
            {by: s[by], "throughput_ratio": s["output_token_throughput"] / e["output_token_throughput"],
             "added_ttft_p50_s": s["ttft"]["p50"] - e["ttft"]["p50"],
             "added_ttft_p99_s": s["ttft"]["p99"] - e["ttft"]["p99"]}
            for s, e in zip(runs["sluice"], runs["engine"])]
    console = Console(width=170)
    console.print(_table(f"{requests} requests per level, prompts {prompt_words} words, "
                         f"max_tokens {output_tokens}", by, runs))
    for row in figures.get("sluice_vs_engine", []):
        console.print(f"{by} {row[by]:g}: throughput ratio {row['throughput_ratio']:.3f}, added TTFT "
                      f"p50 {row['added_ttft_p50_s'] * 1e3:+.0f} ms, p99 {row['added_ttft_p99_s'] * 1e3:+.0f} ms")
    if out:
        out.write_text(json.dumps(figures, indent=2))
    if plot:
        _plot(plot, by, runs)
