"""Counting Redis commands per request: INFO commandstats, commands run by scripts included."""

from __future__ import annotations

import redis

from sluice.bench.commands import commandstats


def test_commands_are_counted_with_those_a_script_runs(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    client.config_resetstat()
    client.set("bench:a", 1)
    client.eval("redis.call('INCR', KEYS[1]); redis.call('INCR', KEYS[1]); return 1", 1, "bench:a")
    calls = commandstats(client)
    assert calls["set"] == 1 and calls["eval"] == 1 and calls["incr"] == 2
    assert "info" not in calls and not any(name.startswith("config") for name in calls)
    client.close()
