"""The worker's start, in-process with the null engine against a private Redis: its own process
freezes its start-up heap once the engine has started, and a Redis failover met by its first
heartbeat does not end it."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis

from sluice.broker.intake.admission import Admission
from sluice.config.batching import ContinuousBatchingConfig
from sluice.config.model import ModelConfig
from sluice.config.settings import Settings
from sluice.workers.engines.null import NullEngine
from sluice.workers.worker import Worker
from tests.workers.test_worker_null import MODEL, _all_done, admission, eventually, stop, submit

__all__ = ["admission"]  # the fixture, shared

async def test_a_worker_process_freezes_its_start_up_heap_once_its_engine_started(redis: Redis,
                                                                                  settings: Settings) -> None:
    """The worker's own process (workers/process.py) freezes what its start made, the engine's
    included, as vLLM's engine core does: full collections walking it took 30 to 140 ms under
    load. A worker in a test's process leaves the collector alone."""
    import gc

    class Started(NullEngine):
        frozen_at_start: int | None = None

        async def start(self) -> None:
            self.frozen_at_start = gc.get_freeze_count()

    model = ModelConfig(name=MODEL)
    assert gc.get_freeze_count() == 0
    for freeze, name in ((False, "gc-a"), (True, "gc-b")):
        engine = Started()
        worker = Worker(settings, model, engine, redis, name, freeze_gc=freeze)
        task = asyncio.create_task(worker.run())
        try:
            await eventually(lambda e=engine, w=worker: e.frozen_at_start is not None and w.replies._task is not None,
                             what="the engine started")
            assert engine.frozen_at_start == 0 and (gc.get_freeze_count() > 0) == freeze
        finally:
            await stop(worker, task)
            gc.unfreeze()


async def test_a_worker_whose_first_heartbeat_meets_a_failover_rides_it_out(
        redis: Redis, settings: Settings, admission: Admission) -> None:
    """A worker's first heartbeat (made before its loop, not by the heartbeat duty that retries)
    met a Redis Cluster failover in a CI run: the primary of its slot killed a moment after the
    worker started, `Connection refused`, and the worker process exited. It waits for Redis as
    its start does, then serves."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    model = ModelConfig(name=MODEL, continuous_batching_config=ContinuousBatchingConfig(max_concurrent_batch_size=4))
    worker = Worker(settings, model, NullEngine(), redis, "blip")
    beat, refused = worker.workers.beat, [RedisConnectionError("Error 111 connecting. Connection refused.")]

    async def failing_over(info):  # type: ignore[no-untyped-def]
        if refused:
            raise refused.pop()
        return await beat(info)

    worker.workers.beat = failing_over  # type: ignore[method-assign]
    task = asyncio.create_task(worker.run())
    try:
        msgs = await submit(admission, 2, max_tokens=3)
        await eventually(lambda: _all_done(redis, msgs), what="both requests done after the blip")
        assert not refused and not task.done()
    finally:
        await stop(worker, task)
