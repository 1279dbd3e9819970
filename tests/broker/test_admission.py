"""Admission, cancel and the model registry against a real Redis."""

from __future__ import annotations

import random

import pytest
from redis.asyncio import Redis

from sluice.broker.intake.admission import QueueFull
from sluice.broker.keys import MODELS
from sluice.broker.registry import ModelRegistry
from sluice.config.batching import ContinuousBatchingConfig, DynamicBatchingConfig
from sluice.config.model import ModelConfig
from sluice.config.settings import Settings
from sluice.protocol.messages import (
    FinalResult,
    RequestMessage,
    State,
)
from tests.broker.helpers import (
    KEYS,
    MODEL,
    admission,
    assert_request_keys_expire,
    cancels,
    done_result,
    fetch_one,
    message,
    pending,
    queued_len,
    ready_consumer,
    replies,
    running_request,
    statuses,
    submit_n,
)

# -- admission --------------------------------------------------------------------------------


async def test_submit_enqueues_and_creates_a_queued_status(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    m = message()
    entry = await adm.submit(m, max_queued=10)
    assert await redis.xlen(KEYS.requests) == 1
    assert await redis.xlen(KEYS.bulk) == 0
    (got_id, fields), = await redis.xrange(KEYS.requests)
    assert got_id == entry
    assert RequestMessage.from_fields(fields) == m
    status = await statuses(redis, settings).status(MODEL, m.id)
    assert status is not None and status.state is State.QUEUED
    assert status.entry == entry
    assert 0 < await redis.ttl(KEYS.status(m.id)) <= settings.status_ttl_s
    found = await statuses(redis, settings).find_status(m.id, ["other", MODEL])
    assert found is not None and (found.model, found.entry) == (MODEL, entry)
    assert await statuses(redis, settings).find_status("req-unknown", ["other", MODEL]) is None


async def test_bulk_requests_go_to_the_bulk_stream(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    await adm.submit(message(lane="bulk"), max_queued=10)
    assert await redis.xlen(KEYS.bulk) == 1
    assert await redis.xlen(KEYS.requests) == 0


async def test_submit_refuses_at_the_bound(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    for _ in range(3):
        await adm.submit(message(), max_queued=3)
    refused = message()
    with pytest.raises(QueueFull):
        await adm.submit(refused, max_queued=3)
    assert await queued_len(redis) == 3
    assert await statuses(redis, settings).status(MODEL, refused.id) is None


async def test_pending_entries_count_toward_the_bound_until_committed(
        redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    await adm.submit(message(), max_queued=1)
    c = await ready_consumer(redis, settings)
    d = await fetch_one(c)
    with pytest.raises(QueueFull):  # fetched but not finished: still counts
        await adm.submit(message(), max_queued=1)
    assert await c.start(d) == "run"
    assert await c.commit(d, done_result())
    await adm.submit(message(), max_queued=1)


# -- cancel -----------------------------------------------------------------------------------


async def test_cancel_of_a_queued_request_ends_it_at_once(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    (m,) = await submit_n(adm, 1)
    assert await cancels(redis, settings).cancel(MODEL, m.id) == "cancelled"
    status = await statuses(redis, settings).status(MODEL, m.id)
    assert status is not None and status.state is State.CANCELLED
    events = await replies(redis, m.id)
    assert [f["kind"] for _, f in events] == ["final"]
    assert FinalResult.model_validate_json(events[0][1]["data"]).status is State.CANCELLED
    await assert_request_keys_expire(redis)

    # its entry is gone: no worker fetches it, and it no longer counts against the bound
    assert await redis.xlen(KEYS.requests) == 0
    c = await ready_consumer(redis, settings)
    assert await c.fetch(1, 10) == []
    assert await pending(redis) == []
    assert len(await replies(redis, m.id)) == 1
    # a second cancel reports the final state and changes nothing
    assert await cancels(redis, settings).cancel(MODEL, m.id) == "cancelled"
    assert len(await replies(redis, m.id)) == 1


async def test_a_cancel_between_a_fetch_and_the_start_runs_nothing(redis: Redis, settings: Settings) -> None:
    """The worker that fetched the request before the cancel drops it without running it or
    writing again."""
    adm = admission(redis, settings)
    (m,) = await submit_n(adm, 1)
    c = await ready_consumer(redis, settings)
    d = await fetch_one(c)
    assert await cancels(redis, settings).cancel(MODEL, m.id) == "cancelled"
    assert await redis.xlen(KEYS.requests) == 0 and await pending(redis) == []
    assert await c.start(d) == "final"
    assert len(await replies(redis, m.id)) == 1


@pytest.mark.parametrize("seed", range(8))
async def test_cancelled_requests_stop_counting_against_the_bound(
        redis: Redis, settings: Settings, seed: int) -> None:
    """Admissions (both lanes), cancels, fetches, starts and commits in an order the seed draws:
    after every step the streams hold exactly the unfinished requests, and an admission is
    refused only when they fill max_queued. A cancelled queued request once kept its place until
    a worker read it."""
    rng = random.Random(seed)
    adm = admission(redis, settings)
    c = await ready_consumer(redis, settings)
    bound, live, fetched, running = 4, [], [], []
    for _ in range(60):
        step = rng.choice(["admit", "admit", "cancel", "cancel", "fetch", "commit"])
        if step == "admit":
            m = message(lane=rng.choice(["interactive", "bulk"]))
            if len(live) < bound:  # bulk's share of 4 is 2: room on the lane too
                lane = [x for x in live if x.lane == m.lane]
                if m.lane == "bulk" and len(lane) >= 2:
                    continue
                await adm.submit(m, max_queued=bound)
                live.append(m)
            else:
                with pytest.raises(QueueFull):
                    await adm.submit(m, max_queued=bound)
        elif step == "cancel" and live:
            m = rng.choice(live)
            state = await cancels(redis, settings).cancel(MODEL, m.id)
            if m.id not in running:
                assert state == "cancelled"
                live.remove(m)
        elif step == "fetch":
            for d in await c.fetch(1, 10):
                if await c.start(d) == "run":
                    running.append(d.message.id)
                    fetched.append(d)
        elif step == "commit" and fetched:
            d = fetched.pop(0)
            await c.commit(d, done_result())
            running.remove(d.message.id)
            live[:] = [x for x in live if x.id != d.message.id]
        assert await queued_len(redis) + await queued_len(redis, KEYS.bulk) == len(live), (seed, step)


async def test_cancel_of_a_running_request_sets_the_flag(redis: Redis, settings: Settings) -> None:
    adm, m, c, d = await running_request(redis, settings)
    assert await cancels(redis, settings).cancel(MODEL, m.id) == "cancelling"
    assert (await statuses(redis, settings).status(MODEL, m.id)).state is State.RUNNING  # type: ignore[union-attr]
    assert 0 < await redis.ttl(KEYS.cancel(m.id)) <= settings.cancel_ttl_s
    assert await c.cancelled([m.id, "req-other"]) == {m.id}
    assert await replies(redis, m.id) == []


async def test_cancel_of_a_finished_or_unknown_request(redis: Redis, settings: Settings) -> None:
    adm, m, c, d = await running_request(redis, settings)
    assert await c.commit(d, done_result())
    assert await cancels(redis, settings).cancel(MODEL, m.id) == "done"
    assert await redis.exists(KEYS.cancel(m.id)) == 0
    assert await cancels(redis, settings).cancel(MODEL, "req-unknown") is None


# -- model registry ---------------------------------------------------------------------------


async def test_deploy_versions_changed_deployments_only(redis: Redis) -> None:
    registry = ModelRegistry(redis)
    base = ModelConfig(name="m")
    assert (await registry.deploy(base)).version == 1
    assert (await registry.deploy(base)).version == 1
    assert (await registry.deploy(base.model_copy(update={"version": 9}))).version == 1

    changed = ModelConfig(name="m", continuous_batching_config=ContinuousBatchingConfig(
        max_concurrent_batch_size=8))
    v2 = await registry.deploy(changed)
    assert v2.version == 2
    assert v2.continuous.max_concurrent_batch_size == 8
    assert (await registry.deploy(changed)).version == 2

    kept = await registry.deploy(
        ModelConfig(name="m", dynamic_batching_config=DynamicBatchingConfig()), keep_existing=True)
    assert kept == v2
    assert await registry.get("m") == v2

    # another model is versioned on its own; keep_existing stores a model not yet there
    other = await registry.deploy(ModelConfig(name="n", batch_config="single"), keep_existing=True)
    assert other.version == 1
    assert [m.name for m in await registry.all()] == ["m", "n"]
    assert await registry.get("absent") is None
    assert await redis.hlen(MODELS) == 2


async def test_back_to_an_earlier_deployment_is_a_new_version(redis: Redis) -> None:
    registry = ModelRegistry(redis)
    a = ModelConfig(name="m")
    b = ModelConfig(name="m", batch_config="single")
    assert [(await registry.deploy(x)).version for x in (a, b, a)] == [1, 2, 3]
