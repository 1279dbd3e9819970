"""The worker's pace against a private Redis: with a TPOT target it holds its engine
concurrency down while tokens come slower than the target, and every worker reports in its
heartbeat how many it admits at once and how many it finishes per second (the api's TTFT
bound is made of these)."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis

from sluice.broker.intake.admission import Admission
from sluice.broker.limits import AdmissionLimits
from sluice.broker.registry import WorkerRegistry
from sluice.config.model import parse_model
from sluice.config.settings import Settings
from sluice.workers.engines.null import NullEngine
from sluice.workers.worker import Worker
from tests.workers.test_worker_null import CountingEngine, _all_done, eventually, states, submit

LIMITS = AdmissionLimits(status_ttl_s=600, reply_ttl_s=60, cancel_ttl_s=60)


async def run_worker(redis: Redis, settings: Settings, slo: dict | None, engine: NullEngine) -> Worker:
    model = parse_model({"name": "t", "continuous_batching_config": {"max_concurrent_batch_size": 8},
                         **({"slo": slo} if slo else {})})
    return Worker(settings.model_copy(update={"heartbeat_interval_s": 0.2}), model, engine, redis, "pace-w")


async def test_a_tpot_target_holds_the_engine_concurrency_down(redis: Redis, settings: Settings) -> None:
    admission = Admission(redis, LIMITS)
    engine = CountingEngine(token_delay_s=0.02)  # 20 ms a token, over a 10 ms target at any concurrency
    worker = await run_worker(redis, settings, {"tpot_ms": 10}, engine)
    task = asyncio.create_task(worker.run())
    try:
        first = await submit(admission, 16, max_tokens=4)
        await eventually(lambda: _all_done(redis, first), what="the first 16 done")
        assert engine.peak == 8 and worker.policy.admitted < 8  # it started at capacity, then held back
        held = worker.policy.admitted
        engine.peak = 0
        rest = await submit(admission, 16, max_tokens=4)
        await eventually(lambda: _all_done(redis, rest), what="the next 16 done")
        assert engine.peak <= held
        await eventually(lambda: _beat_says(redis, admitted=worker.policy.admitted), what="the heartbeat")
        (info,) = await WorkerRegistry(redis).live(10)
        assert info.service_rate > 0
    finally:
        worker.stopping.set()
        await asyncio.wait_for(task, 30)


async def test_the_limit_drops_before_the_burst_that_filled_the_engine_finishes(
        redis: Redis, settings: Settings) -> None:
    # A burst fills the engine at once; its requests are long (100 tokens, 2 s each). The limit
    # must come down while they still run, from the gaps between their tokens: waiting for
    # finished requests (as it once did) acts only after the whole burst is in.
    admission = Admission(redis, LIMITS)
    engine = CountingEngine(token_delay_s=0.02)
    worker = await run_worker(redis, settings, {"tpot_ms": 10}, engine)
    task = asyncio.create_task(worker.run())
    try:
        burst = await submit(admission, 8, max_tokens=100)
        await eventually(lambda: engine.peak == 8, what="the engine filled")
        await eventually(lambda: worker.policy.limit < 8, what="the limit down")
        assert "done" not in await states(redis, burst)  # none of the burst had finished
        # the rate the api bounds the queue with: limit / (100 tokens x the gap), at most 8 / 2 s
        assert 0 < worker.pace.service_rate(100) <= 8 / (100 * 0.02) * 1.05
    finally:
        worker.stopping.set()
        await asyncio.wait_for(task, 30)


async def test_without_a_target_a_worker_admits_its_capacity_and_reports_its_rate(
        redis: Redis, settings: Settings) -> None:
    admission = Admission(redis, LIMITS)
    worker = await run_worker(redis, settings, None, NullEngine(token_delay_s=0.01))
    task = asyncio.create_task(worker.run())
    try:
        await eventually(lambda: _beat_says(redis, admitted=8, rate=0.0), what="a first heartbeat, rate unknown")
        done = await submit(admission, 8, max_tokens=5)
        await eventually(lambda: _all_done(redis, done), what="8 done")
        await eventually(lambda: _beat_says(redis, admitted=8), what="a heartbeat after them")
        (info,) = await WorkerRegistry(redis).live(10)
        # 8 at once, each about 50 ms: on the order of 160/s (a loaded machine is slower)
        assert 10 < info.service_rate < 400
    finally:
        worker.stopping.set()
        await asyncio.wait_for(task, 30)


async def _beat_says(redis: Redis, *, admitted: int, rate: float | None = None) -> bool:
    live = await WorkerRegistry(redis).live(10)
    return bool(live) and live[0].admitted == admitted and (
        live[0].service_rate > 0 if rate is None else live[0].service_rate == rate)
