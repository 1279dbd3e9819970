"""`sluice bench serve --against vllm --repeat N`: both sides measured N times, alternating which
goes first, and each level's median ratio reported (the runs themselves are stubbed here)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from sluice.bench import serve as serve_mod
from sluice.bench.app import bench_app


def _level(level: float, tok_s: float) -> dict:
    timing = {"p50": 0.1, "p90": 0.1, "p99": 0.1, "mean": 0.1}
    return {"concurrency": level, "request_throughput": 1.0, "output_token_throughput": tok_s, "goodput": 1.0,
            "ttft": timing, "tpot": timing, "itl": timing, "e2e": timing, "queue_wait": dict(timing, p50=None)}


def test_repeats_alternate_the_order_and_report_the_median_ratio(tmp_path: Path, monkeypatch) -> None:
    orders: list[list[str]] = []
    sluice_speeds = iter([90.0, 100.0, 99.0])  # against vllm's 100: ratios 0.90, 1.00, 0.99

    def measured(targets, *_):
        orders.append(list(targets))
        speed = next(sluice_speeds)
        return {"vllm" if t == "vllm" else "sluice": [_level(8, 100.0 if t == "vllm" else speed),
                                                       _level(32, 200.0 if t == "vllm" else 2 * speed)]
                for t in targets}

    monkeypatch.setattr(serve_mod, "_targets", measured)
    out = tmp_path / "serve.json"
    done = CliRunner().invoke(bench_app, ["serve", "--against", "vllm", "--repeat", "3", "--concurrency", "8,32",
                                          "--out", str(out)])
    assert done.exit_code == 0, done.output
    assert orders == [["vllm", "sluice-openai"], ["sluice-openai", "vllm"], ["vllm", "sluice-openai"]]
    figures = json.loads(out.read_text())
    assert figures["median_throughput_ratio"] == {"8": 0.99, "32": 0.99}
    assert [r["sluice_vs_vllm"][0]["throughput_ratio"] for r in figures["repeats"]] == [0.9, 1.0, 0.99]
    assert "median 0.990" in done.output


def test_the_frontends_cpu_per_1000_tokens_and_its_ratio_are_reported(tmp_path: Path, monkeypatch) -> None:
    """Each side's frontend processes (vLLM's api server; Sluice's api, worker and Redis) are
    read before and after each level: their CPU per 1,000 output tokens, and Sluice's over vLLM's."""
    from sluice.bench.frontend_cpu import per_level

    def measured(targets, *_):
        runs = {}
        for t in targets:
            level = _level(32, 100.0)  # (per_level is given the level's 1,000 output tokens)
            if t == "vllm":
                level["frontend"] = per_level({"vllm api server": 1.0}, {"vllm api server": 1.5}, 1000)
            else:
                level["frontend"] = per_level({"api": 0.0, "worker": 0.0, "redis": 0.0},
                                              {"api": 0.3, "worker": 0.2, "redis": 0.1}, 1000)
            runs["vllm" if t == "vllm" else "sluice"] = [level]
        return runs

    monkeypatch.setattr(serve_mod, "_targets", measured)
    out = tmp_path / "serve.json"
    done = CliRunner().invoke(bench_app, ["serve", "--against", "vllm", "--repeat", "2", "--concurrency", "32",
                                          "--out", str(out)])
    assert done.exit_code == 0, done.output
    figures = json.loads(out.read_text())
    assert figures["sluice_vs_vllm"][0]["frontend_cpu_ratio"] == 1.2  # 600 ms against 500 ms per 1,000 tokens
    assert figures["median_frontend_cpu_ratio"] == {"32": 1.2}
    assert "Sluice 600 ms (api 0.3 s, worker 0.2 s, redis 0.1 s), vLLM's api server 500 ms: ratio 1.20" in done.output
