"""`sluice bench serve` against a running stack (null engine): the Sluice and OpenAI targets,
the JSON figures and the PNG plot; `sluice bench queue` against Celery."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import NullStack, null_stack

MODELS = "models:\n  - name: bench\n    continuous_batching_config: {max_concurrent_batch_size: 64}\n"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NullStack]:
    with null_stack(tmp_path_factory.mktemp("bench"), MODELS, "bench", SLUICE_NULL_TOKEN_DELAY_S="0.002") as s:
        yield s


@pytest.mark.parametrize("target", ["sluice", "openai"])
def test_bench_serve_against_a_running_stack(stack: NullStack, tmp_path: Path, target: str) -> None:
    out, plot = tmp_path / "serve.json", tmp_path / "serve.png"
    done = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "bench", "serve", "--target", target, "--url", stack.url,
         "--model", "bench", "--concurrency", "1,4", "--requests", "12", "--output-tokens", "4,12",
         "--out", str(out), "--plot", str(plot)],
        capture_output=True, text=True, timeout=300, env=stack.env)
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(out.read_text())
    levels = figures["runs"][target]
    assert [x["concurrency"] for x in levels] == [1, 4]
    for level in levels:
        assert level["completed"] == 12 and level["failed"] == 0
        assert level["output_token_throughput"] > 0 and level["ttft"]["p50"] > 0
        assert level["itl"]["p50"] is not None and level["e2e"]["p99"] >= level["e2e"]["p50"]
        if target == "sluice":
            assert level["queue_wait"]["p50"] is not None
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_queue_measures_sluice_and_celery(tmp_path: Path) -> None:
    out = tmp_path / "queue.json"
    done = subprocess.run([sys.executable, "-m", "sluice.cli", "bench", "queue", "--requests", "40",
                           "--concurrency", "4", "--repeat", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(out.read_text())
    rows = {"celery": figures["celery"], **{f"sluice {route}": row for route, row in figures["sluice"].items()}}
    assert set(rows) == {"celery", "sluice one_call", "sluice submit_and_poll"}
    for row in rows.values():
        assert row["round_trips_per_s"] > 0
        assert row["latency_p99_ms"] >= row["latency_p50_ms"] > 0
    assert figures["sluice_vs_celery_throughput"]["one_call"] > 0
    runs = figures["repeats"]  # --repeat 2: measured twice, Celery first the second time
    assert len(runs) == 2 and runs[0]["sluice"] == figures["sluice"]
    ratios = sorted(r["sluice_vs_celery_throughput"]["one_call"] for r in runs)
    assert figures["median_sluice_vs_celery_throughput"]["one_call"] == pytest.approx(sum(ratios) / 2)
    for cost in figures["redis_commands"]:
        assert cost["commands_per_request"] > 0
