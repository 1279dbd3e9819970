"""Batching policies as pure asyncio logic over an abstract source of requests."""

from sluice.batching.base import BatchingPolicy, Clock, Item, MonotonicClock, Source
from sluice.batching.continuous import ContinuousAdmission
from sluice.batching.dynamic import DynamicBatcher
from sluice.batching.single import SingleBatcher

__all__ = [
    "BatchingPolicy", "Clock", "ContinuousAdmission", "DynamicBatcher", "Item", "MonotonicClock",
    "SingleBatcher", "Source",
]
