"""Cross-check of `sluice bench serve --against vllm`: the same kind of load, driven by vLLM's
own client (`vllm bench serve --backend openai`: random prompts of 64 tokens, 64 output tokens,
--ignore-eos) against Sluice's OpenAI api and then against `vllm serve` with the deployment's
engine options, never both at once. Prints both servers' figures as vLLM's client reports them.

    .venv/bin/python scripts/crosscheck_vllm_bench.py --num-prompts 16 --max-concurrency 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from sluice.bench.throughput import local_stack
from sluice.bench.vllm_server import vllm_serve
from sluice.config.model import load_models
from sluice.config.settings import Settings
from sluice.supervisor.processes import free_port
from sluice.workers.engines.vllm import engine_args
from sluice.workers.model_prep import resolve_model_path

FIGURES = ["completed", "duration", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
           "median_tpot_ms", "median_itl_ms"]


def vllm_bench(url: str, name: str, tokenizer: str, out: Path, args: argparse.Namespace) -> dict:
    subprocess.run([sys.executable, "-m", "sluice.bench.vllm_server", "bench", "serve", "--backend", "openai",
                    "--base-url", url, "--endpoint", "/v1/completions", "--model", name,
                    "--tokenizer", tokenizer,
                    "--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "64",
                    "--ignore-eos", "--num-prompts", str(args.num_prompts), "--max-concurrency",
                    str(args.max_concurrency), "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
                    "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(out.parent),
                    "--result-filename", out.name], check=True, timeout=3600)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-concurrency", type=int, default=1)
    args = parser.parse_args()
    settings = Settings()
    model = load_models(settings.models_file)[0]
    path = resolve_model_path(model.path, settings.cache_dir)
    kwargs, _ = engine_args(path, model.framework_config)
    tmp = Path(tempfile.mkdtemp(prefix="sluice-crosscheck-"))
    with local_stack(model.name) as url:
        sluice = vllm_bench(url, model.name, str(path), tmp / "sluice.json", args)
    log = tmp / "vllm-serve.log"
    with vllm_serve(kwargs.pop("model"), kwargs, served_name=model.name, port=free_port(), log=log) as url:
        vllm = vllm_bench(url, model.name, str(path), tmp / "vllm.json", args)
    print(f"vllm bench serve, {args.num_prompts} prompts, max concurrency {args.max_concurrency}")
    print(f"{'figure':<20}{'vllm serve':>14}{'Sluice':>14}{'ratio':>10}")
    for key in FIGURES:
        a, b = vllm.get(key), sluice.get(key)
        ratio = f"{b / a:.2f}" if isinstance(a, int | float) and isinstance(b, int | float) and a else "-"
        print(f"{key:<20}{a!s:>14.8}{b!s:>14.8}{ratio:>10}")
    print(f"results: {tmp}")


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    main()
