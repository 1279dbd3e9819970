"""Sluice's processes (Redis, apis, workers) as children of this one: `sluice up`, the benchmarks
and the tests."""
