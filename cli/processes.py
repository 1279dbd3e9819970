"""Child processes of `sluice up`, the benchmarks and the end-to-end tests."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable

import httpx


def wait_ready(url: str, procs: list[subprocess.Popen], timeout_s: float = 900,
               cancelled: Callable[[], bool] = lambda: False) -> bool:
    """Until `url`/readyz answers 200 (True) or `cancelled()` (False); raises if a process
    exits first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cancelled():
            return False
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args} exited with {p.returncode} before {url} was ready")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{url} not ready after {timeout_s}s")


def stop_processes(procs: list[subprocess.Popen], timeout_s: float = 60) -> None:
    """SIGTERM all (in the order given: workers first lets them drain), then wait, then kill."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
