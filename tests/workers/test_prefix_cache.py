"""The simulated prefix cache (LRU over chained block hashes, counted as vLLM counts), the null
engine that uses it, and a worker exporting its engine's hit counters: in its Prometheus metrics,
its heartbeat and the dashboard's data (issue 34)."""

from __future__ import annotations

import time
import uuid

import pytest
from prometheus_client import REGISTRY
from redis.asyncio import Redis

from sluice.broker.intake.admission import Admission
from sluice.broker.registry import WorkerRegistry
from sluice.protocol.messages import RequestMessage, SamplingSpec
from sluice.protocol.prefix import block_hashes
from sluice.workers.engines.base import GenerationRequest
from sluice.workers.engines.null import NullEngine
from sluice.workers.engines.prefix_cache import PrefixCacheCounters, SimulatedPrefixCache
from sluice.workers.engines.vllm import prefix_stat_logger
from sluice.workers.metrics import PrefixCacheExport
from tests.workers.test_worker_null import MODEL, WorkerFactory, admission, eventually, settings, start_worker  # noqa: F401

SYSTEM = " ".join(f"s{i}" for i in range(48))  # three blocks of 16 words


def blocks(tokens: list[int]) -> list[bytes]:
    return block_hashes(tokens, 16)


def test_a_shared_prefix_is_a_hit_up_to_the_first_block_that_differs() -> None:
    cache = SimulatedPrefixCache(capacity_blocks=100)
    a = list(range(64))
    assert cache.admit(blocks(a), len(a) + 3) == 0  # a cold cache: all computed
    b = a[:32] + [999] * 32
    assert cache.admit(blocks(b), len(b)) == 32  # blocks 0 and 1 shared, block 2 differs
    assert (cache.counters.queries, cache.counters.hits) == (67 + 64, 32)
    assert len(cache) == 6  # a's four blocks and b's last two


def test_the_least_recently_used_blocks_go_first() -> None:
    cache = SimulatedPrefixCache(capacity_blocks=4)
    a, b = list(range(32)), list(range(100, 132))
    cache.admit(blocks(a), 40)
    cache.admit(blocks(b), 40)
    cache.admit(blocks(a), 40)  # a is used again: b is now the least recent
    c = list(range(200, 232))
    cache.admit(blocks(c), 40)  # room for c: b goes
    assert cache.cached_blocks(blocks(a)) == 2 and cache.cached_blocks(blocks(b)) == 0
    assert cache.cached_blocks(blocks(c)) == 2


def test_a_prompt_of_cached_blocks_only_still_computes_its_last_block() -> None:
    cache = SimulatedPrefixCache(capacity_blocks=10)
    a = list(range(32))
    cache.admit(blocks(a), 32)
    assert cache.admit(blocks(a), 32) == 16  # as vLLM: the last token is always computed


def test_a_cache_of_no_blocks_holds_nothing() -> None:
    cache = SimulatedPrefixCache(capacity_blocks=0)
    a = list(range(32))
    cache.admit(blocks(a), 40)
    assert cache.admit(blocks(a), 40) == 0 and len(cache) == 0
    with pytest.raises(ValueError):
        SimulatedPrefixCache(capacity_blocks=-1)


async def _run(engine: NullEngine, prompt: str) -> None:
    async for _ in engine.generate(GenerationRequest(request_id=uuid.uuid4().hex, prompt=prompt, max_tokens=2)):
        pass


async def test_the_null_engine_counts_hits_of_prompts_sharing_words() -> None:
    engine = NullEngine(prefix_cache_blocks=64)
    assert NullEngine().prefix_cache_counters() is None
    await _run(engine, SYSTEM + " first question")
    await _run(engine, SYSTEM + " second question")
    counters = engine.prefix_cache_counters()
    assert counters is not None and (counters.queries, counters.hits) == (100, 48)


def test_the_vllm_stat_logger_sums_the_prefix_cache_stats_of_each_step() -> None:
    """As vLLM's output handler calls a custom stat logger (SchedulerStats per step)."""
    from vllm.v1.metrics.stats import PrefixCacheStats, SchedulerStats

    counters = PrefixCacheCounters()
    logger = prefix_stat_logger(counters)(None, 0)
    for queries, hits in ((100, 0), (120, 96)):
        stats = PrefixCacheStats()
        stats.record(num_tokens=queries, num_hits=hits, preempted=False)
        stats.record(num_tokens=50, num_hits=50, preempted=True)  # a preempted request's lookup: not counted
        logger.record(SchedulerStats(prefix_cache_stats=stats), None)
    logger.record(None, None)
    assert (counters.queries, counters.hits) == (220, 96)


def test_the_vllm_stat_logger_reports_the_cache_s_size_once_the_engine_is_up() -> None:
    """AsyncLLM sets cache_config.num_gpu_blocks from the engine core before it makes its stat
    loggers, then calls log_engine_initialized: the size in blocks goes into the heartbeat."""
    from types import SimpleNamespace

    counters = PrefixCacheCounters()
    config = SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=12, block_size=128))
    prefix_stat_logger(counters)(config, 0).log_engine_initialized()
    assert (counters.blocks, counters.block_size) == (12, 128)
    beat = PrefixCacheExport.heartbeat(counters)
    assert (beat["prefix_cache_blocks"], beat["prefix_cache_block_size"]) == (12, 128)
    assert (SimulatedPrefixCache(64).counters.blocks, SimulatedPrefixCache(64).counters.block_size) == (64, 16)


def message(prompt: str) -> RequestMessage:
    now = time.time()
    return RequestMessage(id=f"req-{uuid.uuid4().hex}", model=MODEL, rows=[{"prompt": prompt, "max_tokens": 2}],
                          sampling=SamplingSpec(max_tokens=2, seed=1), enqueued_at=now, deadline=now + 60)


def sample(name: str, worker: str) -> float | None:
    return REGISTRY.get_sample_value(f"{name}_total", {"model": MODEL, "worker": worker})


async def test_a_worker_exports_its_engine_s_hit_counters(redis: Redis, admission: Admission,  # noqa: F811
                                                          start_worker: WorkerFactory) -> None:  # noqa: F811
    name = f"prefix-{uuid.uuid4().hex[:6]}"  # the metrics are process-wide: a name of its own
    worker, _ = start_worker(NullEngine(prefix_cache_blocks=64), capacity=1, name=name)
    for question in ("one", "two", "three"):
        await admission.submit(message(f"{SYSTEM} {question}"), max_queued=1000)

    async def reported() -> bool:
        live = [w for w in await WorkerRegistry(redis).live(60) if w.name == worker.name]
        return bool(live) and live[0].prefix_cache_queries == 147

    await eventually(reported, what="the heartbeat to report three prompts' lookups")
    (info,) = [w for w in await WorkerRegistry(redis).live(60) if w.name == worker.name]
    assert info.prefix_cache_hits == 96  # the second and third found the three shared blocks
    assert sample("sluice_prefix_cache_queries", worker.name) == 147
    assert sample("sluice_prefix_cache_hits", worker.name) == 96
