"""Single batch mode: one one-row request at a time, no batching configuration."""

from __future__ import annotations

from sluice.batching.base import Clock
from sluice.batching.dynamic import DynamicBatcher
from sluice.config.batching import DynamicBatchingConfig

_ONE = DynamicBatchingConfig(max_batch_delay_ms=0, batch_size_target=1, batch_size_limit=1)


class SingleBatcher(DynamicBatcher):
    """A batch of exactly one request, the next one when it is done."""

    def __init__(self, *, clock: Clock | None = None, poll_s: float = 0.5):
        super().__init__(_ONE, clock=clock, poll_s=poll_s)
