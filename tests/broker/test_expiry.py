"""The expiry sweep (broker/delivery/expiry.py, lua/expire.lua): a request past its deadline
that no worker started ends `expired`, with one final, whatever a worker does at the same time."""

from __future__ import annotations

import json
import random
import time

import pytest
from redis.asyncio import Redis

from sluice.broker.delivery.expiry import expire_overdue
from sluice.broker.plumbing.scripts import Scripts
from sluice.config.settings import Settings
from tests.broker.helpers import KEYS, admission, done_result, queued_len, ready_consumer, replies, statuses, submit_n

LATER = 1000.0  # the sweep's clock, moved past every deadline (60 s) of the requests below


async def sweep(redis: Redis, *, now: float, lease_timeout_s: float = 30.0) -> list[str]:
    return await expire_overdue(redis, Scripts(redis), KEYS, [KEYS.requests, KEYS.bulk], now=now,
                                lease_timeout_s=lease_timeout_s, result_ttl_s=3600, reply_ttl_s=60)


async def finals(redis: Redis, rid: str) -> list[dict]:
    return [json.loads(f["data"]) for _, f in await replies(redis, rid) if f["kind"] == "final"]


async def test_a_queued_request_of_a_model_without_workers_expires(redis: Redis, settings: Settings) -> None:
    """No worker ever started (the stream has no consumer group): the overdue request ends
    expired, its entry is gone; the one still within its deadline stays queued."""
    adm = admission(redis, settings)
    (late,) = await submit_n(adm, 1, deadline_in=-1)
    (bulk,) = await submit_n(adm, 1, deadline_in=-1, lane="bulk")
    (fresh,) = await submit_n(adm, 1, deadline_in=60)
    assert sorted(await sweep(redis, now=time.time())) == sorted([late.id, bulk.id])
    for m in (late, bulk):
        status = await statuses(redis, settings).status(KEYS.model, m.id)
        assert status.state.value == "expired" and "deadline" in status.result.error
        assert [f["status"] for f in await finals(redis, m.id)] == ["expired"]
    assert (await statuses(redis, settings).status(KEYS.model, fresh.id)).state.value == "queued"
    assert await queued_len(redis) == 1 and await queued_len(redis, KEYS.bulk) == 0
    assert await sweep(redis, now=time.time()) == []  # once


@pytest.mark.parametrize("seed", range(30))
async def test_a_sweep_racing_workers_leaves_one_final(redis: Redis, settings: Settings, seed: int) -> None:
    """Requests fetched by a worker; the worker's start and commit and the sweep (its clock past
    every deadline, the worker's lease live or lapsed) run in an order the seed draws. Each request
    ends with exactly one final: expired when the sweep came before the start or after it with the
    lease lapsed, else the worker's own; nothing is left on the stream or pending."""
    rng = random.Random(seed)
    adm = admission(redis, settings)
    messages = await submit_n(adm, 6)
    c = await ready_consumer(redis, settings)
    deliveries = await c.fetch(6, 1000)
    expected = {}
    steps = [(d, step) for d in deliveries for step in ("start", "commit")] + [(None, "sweep")] * 4
    rng.shuffle(steps)
    started: dict[str, str] = {}
    ran = set()  # started by the worker (its start said "run")
    for d, step in steps:
        if step == "sweep":
            lapsed = rng.random() < 0.5
            await sweep(redis, now=time.time() + LATER, lease_timeout_s=0.0 if lapsed else 3600.0)
            for rid, state in started.items():
                if state == "running" and lapsed:
                    started[rid] = expected[rid] = "expired"
            for m in messages:
                if m.id not in started:
                    started[m.id] = expected[m.id] = "expired"
        elif step == "start":
            decision = await c.start(d)
            if started.get(d.message.id) == "expired":
                assert decision == "final"
            else:
                assert decision == "run"
                started[d.message.id] = "running"
                ran.add(d.message.id)
        elif d.message.id in ran:
            await c.commit(d, done_result())
            if started[d.message.id] == "running":
                started[d.message.id] = expected[d.message.id] = "done"
    for d in deliveries:  # whatever is left: the worker's turn
        if started.get(d.message.id) is None:
            assert await c.start(d) == "run"
            started[d.message.id] = "running"
        if started[d.message.id] == "running":
            await c.commit(d, done_result())
            expected[d.message.id] = "done"
    for m in messages:
        assert [f["status"] for f in await finals(redis, m.id)] == [expected[m.id]], (seed, m.id)
        assert (await statuses(redis, settings).status(KEYS.model, m.id)).state.value == expected[m.id]
    assert await redis.xlen(KEYS.requests) == 0
    assert await redis.xpending(KEYS.requests, "workers") == {"pending": 0, "min": None, "max": None,
                                                              "consumers": []}


@pytest.mark.parametrize("lapsed", [False, True], ids=["lease-live", "lease-lapsed"])
async def test_a_running_request_expires_only_once_its_worker_stopped_renewing(
        redis: Redis, settings: Settings, lapsed: bool) -> None:
    adm = admission(redis, settings)
    (m,) = await submit_n(adm, 1)
    c = await ready_consumer(redis, settings)
    (d,) = await c.fetch(1, 1000)
    assert await c.start(d) == "run"
    swept = await sweep(redis, now=time.time() + LATER, lease_timeout_s=0.0 if lapsed else 3600.0)
    assert swept == ([m.id] if lapsed else [])
    await c.commit(d, done_result())  # the worker comes back: refused once expired
    state = "expired" if lapsed else "done"
    assert [f["status"] for f in await finals(redis, m.id)] == [state]
    assert (await statuses(redis, settings).status(KEYS.model, m.id)).state.value == state
    assert await redis.xlen(KEYS.requests) == 0
