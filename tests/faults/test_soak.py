"""A 2-minute soak (`sluice bench soak`): under steady mixed traffic with a 30 s retention,
Redis memory levels off once finished work expires as fast as it comes (generous bounds:
docs/performance.md's 10-minute run is held to 1% of the level per minute). A memory target: out of
the default run (as the other benchmarks are), `pytest -m soak` runs it; every key's TTL,
which is what keeps memory level, is checked in tests/broker/test_retention.py."""

from __future__ import annotations

import pytest

from sluice.bench.soak import soak

pytestmark = pytest.mark.soak


def test_memory_levels_off_under_steady_load() -> None:
    result = soak(minutes=2, retention_s=30, rate=15, warmup_s=60)
    assert result["error_count"] == 0, result["errors"]
    assert all(n > 0 for n in result["ok"].values()), result["ok"]
    growth = result["growth"]
    assert growth["redis_bytes"]["percent_per_minute"] < 10, growth
    assert growth["api_rss"]["percent_per_minute"] < 10, growth
    assert growth["worker_rss"]["percent_per_minute"] < 10, growth
    # What a finished request holds once its reply stream is gone: its status hash (the output
    # of a null-engine request is a few hundred characters).
    assert 0 < result["per_request_bytes"]["status"] < 2048 + 600, result["per_request_bytes"]
