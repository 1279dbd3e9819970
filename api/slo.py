"""The queue bound a model's TTFT target sets (`slo: {ttft_ms}` in its deployment).

Each worker reports in its heartbeat how many requests it admits to the engine at once and
how many it finishes per second at that concurrency (workers/pace.py). Summed over the
model's live workers: `slots` start at once, and the queue behind them drains at `rate`. A
request that finds `slots + ttft x rate` requests ahead of it in its lane would start past
the target, so it is refused at once (503 with Retry-After) instead of being served late.
While no worker knows its rate yet (nothing finished since it started), no such bound holds.
The live workers are read at most every 0.25 s per api process; a worker whose limit falls
by a quarter beats at once.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from sluice.broker.registry import WorkerInfo, WorkerRegistry
from sluice.config.model import ModelConfig


@dataclass(frozen=True)
class SloBound:
    slots: int
    rate: float  # requests/s the model's workers finish
    max_in_lane: int

    def retry_after_s(self, depth: int, n: int = 1) -> int:
        """Seconds until the lane has drained to where `n` more would start within target."""
        return max(1, math.ceil((depth + n - self.max_in_lane) / self.rate))


class SloBounds:
    def __init__(self, workers: WorkerRegistry, worker_ttl_s: float, *, cache_s: float = 0.25):
        self.workers = workers
        self.worker_ttl_s = worker_ttl_s
        self.cache_s = cache_s
        self._live: list[WorkerInfo] = []
        self._until = 0.0

    async def _workers(self, model: str) -> list[WorkerInfo]:
        now = time.monotonic()
        if now >= self._until:
            self._live = await self.workers.live(self.worker_ttl_s)
            self._until = now + self.cache_s
        return [w for w in self._live if w.model == model and w.state == "running"]

    async def bound(self, model: ModelConfig) -> SloBound | None:
        if model.slo is None or model.slo.ttft_ms is None:
            return None
        live = await self._workers(model.name)
        rate = sum(w.service_rate for w in live)
        if rate <= 0:
            return None
        slots = sum(w.admitted if w.admitted is not None else w.capacity for w in live)
        return SloBound(slots, rate, slots + math.floor(model.slo.ttft_ms / 1000 * rate))
