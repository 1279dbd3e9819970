"""What `sluice bench hostile` attacks and how it watches: the target stack, the resident memory
of its processes read from /proc, and the longest /healthz latency while an attack runs."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx


@dataclass
class Target:
    url: str
    key: str
    spool: Path  # the api's TMPDIR: where an upload would be spooled

    @property
    def address(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        return parts.hostname or "127.0.0.1", parts.port or 80

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def client(self, timeout: float = 120) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers=self.auth, timeout=timeout)


def _children(pid: int) -> list[int]:
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []
    found = []
    for task in tasks:
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def rss_mib(pid: int | None) -> float:
    """The resident memory of `pid` and every process under it (MiB); 0 once it is gone."""
    if pid is None:
        return 0.0
    total, todo, seen = 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        total += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
        todo += _children(p)
    return total / 1024


class Watch(threading.Thread):
    """/healthz latency (a new connection each time) and the peak RSS of the api and of the jobs
    worker, sampled every 50 ms until stopped."""

    def __init__(self, url: str, pid: int, jobs_pid: int | None = None) -> None:
        super().__init__(daemon=True)
        self.url, self.pid, self.jobs_pid = url, pid, jobs_pid
        self.done = threading.Event()
        self.worst_s, self.failed, self.peak_mib, self.jobs_peak_mib = 0.0, 0, 0.0, 0.0

    def sample(self) -> None:
        self.peak_mib = max(self.peak_mib, rss_mib(self.pid))
        self.jobs_peak_mib = max(self.jobs_peak_mib, rss_mib(self.jobs_pid))

    def run(self) -> None:
        sampler = threading.Thread(target=self._sample_until_done, daemon=True)  # not held up by a slow probe
        sampler.start()
        while not self.done.is_set():
            t0 = time.perf_counter()
            try:
                ok = httpx.get(f"{self.url}/healthz", timeout=10).status_code == 200
            except httpx.HTTPError:
                ok = False
            self.worst_s = max(self.worst_s, time.perf_counter() - t0)
            self.failed += not ok
            self.done.wait(0.05)
        sampler.join()

    def _sample_until_done(self) -> None:
        while not self.done.is_set():
            self.sample()
            self.done.wait(0.05)
        self.sample()

    def stop(self) -> Watch:
        self.done.set()
        self.join()
        return self
