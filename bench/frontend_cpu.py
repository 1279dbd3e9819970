"""The CPU each frontend process spends while a load runs, from /proc: `sluice bench serve
--against vllm` compares vLLM's api server process with Sluice's api, worker and Redis, and
`sluice bench tokens` reports the api's, the worker's and Redis's per 1,000 tokens.

A process's own user plus system time (`utime + stime` in /proc/<pid>/stat) counts all of its
threads and none of its children, so a worker's figure leaves out its engine-core process (the
engine, as vLLM's api server's figure leaves out its own), and counts the engine client's
output handling and detokenizing in the worker, as vLLM's counts them in its api server.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def cpu_s(pid: int) -> float:
    """User plus system CPU seconds of a process so far (its threads, not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


Sample = Callable[[], dict[str, float]]


def sampler(pids: dict[str, int]) -> Sample:
    """A reading of every named process's CPU seconds so far."""
    return lambda: {name: cpu_s(pid) for name, pid in pids.items()}


def per_level(before: dict[str, float], after: dict[str, float], output_tokens: float) -> dict:
    """A level's CPU seconds per process, their sum, and the sum per 1,000 output tokens."""
    spent = {name: round(after[name] - before[name], 3) for name in before}
    total = sum(spent.values())
    return {"cpu_s": spent, "cpu_s_total": round(total, 3),
            "cpu_ms_per_1000_tokens": round(total * 1e6 / max(output_tokens, 1), 1)}
