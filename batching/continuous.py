"""Continuous admission: each finished request's slot is refilled from the source at once."""

from __future__ import annotations

import asyncio

from sluice.batching.base import BatchingPolicy, Handler, Source, T
from sluice.config.batching import ContinuousBatchingConfig


class ContinuousAdmission(BatchingPolicy[T]):
    """Up to `max_concurrent_batch_size` single-row requests in the engine at once, beside them
    at most one quarantine group of quarantined requests (the next is asked for once the last of
    it is done): the engine is never drained for a suspect."""

    def __init__(self, config: ContinuousBatchingConfig, *, poll_s: float = 0.5):
        super().__init__()
        self.config = config
        self.poll_s = poll_s
        self._quarantine: set[asyncio.Task[None]] = set()
        # Held below capacity where the model's TPOT target needs it (batching/slo.py)
        self.limit: int | None = None

    @property
    def capacity(self) -> int:
        return self.config.max_concurrent_batch_size

    @property
    def admitted(self) -> int:
        """How many may run at once now: the capacity, or the SLO's limit below it."""
        return min(self.capacity, self.limit) if self.limit is not None else self.capacity

    async def run(self, source: Source[T], handle: Handler[T], stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            free = self.admitted - self.in_flight
            if free <= 0:
                await self._wait_freed_or(stopping)
                continue
            for item in await source.fetch(free, self.poll_s, 0 if self._quarantine else free):
                task = self._launch(handle, [item])
                if item.quarantined:
                    self._quarantine.add(task)
                    task.add_done_callback(self._quarantine.discard)
