"""A model's queue figures (broker/intake/queues.py): waiting and running apart, and the oldest waiting
request's age, not the oldest running one's."""

from __future__ import annotations

import time

from redis.asyncio import Redis

from sluice.broker.intake.queues import LaneFigures, queue_figures
from sluice.config.settings import Settings
from tests.broker.helpers import KEYS, MODEL, admission, done_result, fetch_one, message, ready_consumer, submit_n


async def test_no_stream_is_an_empty_queue(redis: Redis) -> None:
    assert await queue_figures(redis, MODEL) == {"interactive": LaneFigures(), "bulk": LaneFigures()}


async def test_before_any_worker_every_entry_waits(redis: Redis, settings: Settings) -> None:
    await submit_n(admission(redis, settings), 3)  # no consumer group yet
    figures = await queue_figures(redis, MODEL)
    assert figures["interactive"].waiting == 3 and figures["interactive"].running == 0
    assert figures["bulk"] == LaneFigures()


async def test_a_running_request_is_not_waiting(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    await submit_n(adm, 1)
    c = await ready_consumer(redis, settings)
    d = await fetch_one(c)
    assert await c.start(d) == "run"
    assert (await queue_figures(redis, MODEL))["interactive"] == LaneFigures(waiting=0, running=1)
    assert await c.commit(d, done_result())
    assert (await queue_figures(redis, MODEL))["interactive"] == LaneFigures()


async def test_the_oldest_waiting_age_skips_the_running_entries(redis: Redis, settings: Settings) -> None:
    c = await ready_consumer(redis, settings)
    now_ms = int(time.time() * 1000)
    # Entries with ids of the past: one of 600 s ago (a worker takes it), one of 60 s ago (waits).
    for age_s in (600, 60):
        m = message()
        await redis.xadd(KEYS.requests, {"id": m.id, "data": m.model_dump_json()}, id=f"{now_ms - age_s * 1000}-0")
    (taken,) = await c.fetch(1, 1000)
    assert taken.entry_id.startswith(str(now_ms - 600_000))
    lane = (await queue_figures(redis, MODEL))["interactive"]
    assert lane.waiting == 1 and lane.running == 1 and lane.entries == 2
    assert 60 <= lane.oldest_waiting_s < 600  # the waiting entry's age, not the running one's
    assert lane.view() == {"waiting": 1, "running": 1, "oldest_waiting_s": round(lane.oldest_waiting_s, 1)}


async def test_the_bulk_lane_is_counted_apart(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    await adm.submit(message(lane="bulk"), max_queued=100)
    await adm.submit(message(), max_queued=100)
    figures = await queue_figures(redis, MODEL)
    assert figures["interactive"].waiting == 1 and figures["bulk"].waiting == 1
    assert figures["bulk"].running == figures["interactive"].running == 0

