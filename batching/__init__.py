"""Batching policies as pure asyncio logic over an abstract source of requests."""

from sluice.batching.base import BatchingPolicy, Clock, Item, MonotonicClock, Source
from sluice.batching.continuous import ContinuousAdmission

__all__ = ["BatchingPolicy", "Clock", "ContinuousAdmission", "Item", "MonotonicClock", "Source"]
