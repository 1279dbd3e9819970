"""A consumer group that Redis lost (restarted without its data, flushed) is the broker's to
mend: the worker's fetch sees no Redis error, and requests submitted afterwards are served."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from sluice.broker.intake.admission import Admission
from sluice.broker.keys import GROUP
from sluice.broker.limits import AdmissionLimits
from sluice.config.model import ModelConfig
from sluice.config.settings import Settings
from sluice.workers.engines.null import NullEngine
from tests.workers.test_worker_delivery import final_of, is_final, start
from tests.workers.test_worker_null import KEYS, MODEL, eventually, submit


@pytest.fixture
async def workers() -> AsyncIterator[list]:
    started: list = []
    yield started
    for worker, _ in started:
        worker.stopping.set()
    await asyncio.wait_for(asyncio.gather(*(t for _, t in started), return_exceptions=True), 30)


async def test_a_lost_consumer_group_is_recreated_and_serving_goes_on(
        redis: Redis, settings: Settings, workers: list) -> None:
    admission = Admission(redis, AdmissionLimits.of(settings))
    worker = await start(redis, settings, workers, NullEngine(token_delay_s=0.001), ModelConfig(name=MODEL))
    (first,) = await submit(admission, 1, max_tokens=2)
    await eventually(lambda: is_final(redis, first.id), what="the first request final")
    for stream in (KEYS.requests, KEYS.bulk):
        await redis.xgroup_destroy(stream, GROUP)
    assert await worker.consumer.fetch(1, 10) == []  # mended, not raised
    assert [g["name"] for g in await redis.xinfo_groups(KEYS.requests)] == [GROUP]
    (second,) = await submit(admission, 1, max_tokens=2)
    await eventually(lambda: is_final(redis, second.id), what="a request after the loss final")
    assert (await final_of(redis, second.id)).status.value == "done"
