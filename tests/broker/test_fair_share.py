"""Tenants' fair share of a lane (admit.lua stages, dispatch.lua orders, settle.lua corrects): on
a real Redis, driven step by step (the steps are the clock: no sleeps, no timing), with seeded
random arrivals of many tenants."""

from __future__ import annotations

import dataclasses
import random
import time
import uuid

import pytest
from redis.asyncio import Redis

from sluice.broker import keys
from sluice.broker.delivery.consumer import Delivery, StreamConsumer
from sluice.broker.delivery.expiry import expire_overdue
from sluice.broker.delivery.fair_share import (
    OUTPUT_WEIGHT,
    RESERVE_BLOCK_MS,
    SlotReserves,
    expected_cost,
    prompt_tokens,
)
from sluice.broker.intake.admission import Admission, QueueFull, TenantQueueFull
from sluice.broker.limits import TenantShare
from sluice.broker.plumbing.scripts import Scripts
from sluice.config.settings import Settings
from sluice.protocol.messages import FinalResult, RequestMessage, RowOutput, SamplingSpec, State, Usage
from tests.broker.helpers import KEYS, MODEL, admission, cancels, queued_len, ready_consumer, statuses

LANE = KEYS.requests


def request(tenant: str, *, prompt_chars: int = 40, max_tokens: int = 16, deadline_in: float = 3600.0,
            lane: str = "interactive") -> RequestMessage:
    now = time.time()
    return RequestMessage(id=f"req-{uuid.uuid4().hex}", model=MODEL,
                          rows=[{"prompt": "x" * prompt_chars, "max_tokens": max_tokens}],
                          sampling=SamplingSpec(max_tokens=max_tokens, seed=1), enqueued_at=now,
                          deadline=now + deadline_in, lane=lane, tenant=tenant)


def finished(d: Delivery, output_tokens: int) -> FinalResult:
    row = d.message.rows[0]
    return FinalResult(status=State.DONE, output=RowOutput(text="t" * output_tokens, num_output_tokens=output_tokens),
                       usage=Usage(prompt_tokens=prompt_tokens(row), completion_tokens=output_tokens))


async def run_and_commit(c: StreamConsumer, d: Delivery, output_tokens: int) -> None:
    assert await c.start(d) == "run"
    assert await c.commit(d, finished(d, output_tokens)) is True


async def backlog(redis: Redis, stream: str = LANE) -> dict[str, float]:
    return dict(await redis.zrange(keys.backlog(stream), 0, -1, withscores=True))


# -- the share of the engine --------------------------------------------------------------------

WEIGHTS = {"a": 1.0, "b": 1.0, "c": 2.0, "d": 3.0, "e": 1.0, "f": 0.5}
CAPACITY = 4
MAX_TOKENS = 64
MAX_PROMPT_CHARS = 400


async def drive(redis: Redis, settings: Settings, seed: int, *, steps: int, fair: bool = True) -> dict[str, list]:
    """Random arrivals of six tenants (two flood the lane, the others come and go), one worker
    of CAPACITY slots that finishes a random part of what runs at each step with a random output
    (at most max_tokens: the counter's charge is corrected at the final). Returns, per step, the
    counters of the backlogged tenants and each tenant's served tokens over its weight."""
    rng = random.Random(seed)
    adm = admission(redis, settings)
    adm.limits = dataclasses.replace(adm.limits, fair_share=fair)
    c = await ready_consumer(redis, settings)
    running: list[Delivery] = []
    served = dict.fromkeys(WEIGHTS, 0.0)
    trace: dict[str, list] = {"gaps": [], "served": []}
    for _ in range(steps):
        for tenant, weight in WEIGHTS.items():
            # a and b flood (3 and 1 a step); the others arrive now and then
            arrivals = {"a": 3, "b": 1}.get(tenant, int(rng.random() < 0.15))
            for _ in range(arrivals):
                m = request(tenant, prompt_chars=rng.randint(4, MAX_PROMPT_CHARS),
                            max_tokens=rng.randint(1, MAX_TOKENS))
                await adm.submit(m, max_queued=100_000, share=TenantShare(weight=weight))
        for d in await c.fetch(CAPACITY - len(running), 10):
            assert await c.start(d) == "run"
            running.append(d)
        for d in [d for d in running if rng.random() < 0.5]:
            out = rng.randint(1, d.message.sampling.max_tokens)
            assert await c.commit(d, finished(d, out)) is True
            running.remove(d)
            row = d.message.rows[0]
            served[d.message.tenant] += (prompt_tokens(row) + OUTPUT_WEIGHT * out) / WEIGHTS[d.message.tenant]
        trace["gaps"].append(await backlog(redis))
        trace["served"].append(dict(served))
    return trace


def max_cost() -> float:
    """The most one request can move a counter: its charge (over the smallest weight)."""
    return (-(-MAX_PROMPT_CHARS // 4) + OUTPUT_WEIGHT * MAX_TOKENS) / min(WEIGHTS.values())


# Counters of backlogged tenants stay within two requests' cost of one another: one charge ahead
# of the smallest (dispatch always serves the smallest), one more for a correction or a lift.
COUNTER_BOUND = 2 * max_cost()
# Served tokens (counted at the final) differ by that and the requests in flight on top.
BOUND = (CAPACITY + 2) * max_cost()


@pytest.mark.parametrize("seed", range(8))
async def test_backlogged_tenants_counters_stay_within_a_fixed_bound(redis: Redis, settings: Settings,
                                                                     seed: int) -> None:
    trace = await drive(redis, settings, seed, steps=150)
    for step, counters in enumerate(trace["gaps"]):
        if len(counters) > 1:
            gap = max(counters.values()) - min(counters.values())
            assert gap <= COUNTER_BOUND, (seed, step, counters)
    # a floods at 3 a step, b at 1: both always backlogged, they are served alike (over weight)
    for step, served in enumerate(trace["served"][20:], start=20):
        assert abs(served["a"] - served["b"]) <= BOUND, (seed, step, served)


async def test_fifo_breaks_that_bound(redis: Redis, settings: Settings) -> None:
    """The check above has teeth: plain FIFO serves a three times as much as b."""
    trace = await drive(redis, settings, 0, steps=150, fair=False)
    served = trace["served"][-1]
    assert served["a"] - served["b"] > 2 * BOUND, served


async def test_weights_divide_the_engine(redis: Redis, settings: Settings) -> None:
    """Two flooding tenants weighted 3 : 1 are served 3 : 1 (within a request's cost)."""
    adm, c = admission(redis, settings), await ready_consumer(redis, settings)
    shares = {"heavy": TenantShare(weight=3.0), "light": TenantShare(weight=1.0)}
    for _ in range(200):
        for tenant, share in shares.items():
            await adm.submit(request(tenant), max_queued=10_000, share=share)
    served = dict.fromkeys(shares, 0)
    for _ in range(120):
        (d,) = await c.fetch(1, 10)
        await run_and_commit(c, d, 16)
        served[d.message.tenant] += 1
    assert abs(served["heavy"] - 3 * served["light"]) <= 4, served


async def test_an_idle_tenant_banks_no_credit(redis: Redis, settings: Settings) -> None:
    """b, idle while a was served, joins at a's counter: it is not served alone until it has
    caught up with everything a got meanwhile."""
    adm, c = admission(redis, settings), await ready_consumer(redis, settings)
    for _ in range(40):
        await adm.submit(request("a"), max_queued=10_000)
    for _ in range(30):
        (d,) = await c.fetch(1, 10)
        await run_and_commit(c, d, 16)
    a_counter = (await backlog(redis))["a"]
    assert a_counter > 0
    for _ in range(10):
        await adm.submit(request("b"), max_queued=10_000)
    # lifted to a's counter (its first request was charged from there): no credit for the idle time
    assert float(await redis.hget(keys.counters(LANE), "b")) >= a_counter
    order = []
    for _ in range(10):
        (d,) = await c.fetch(1, 10)
        await run_and_commit(c, d, 16)
        order.append(d.message.tenant)
    assert order.count("a") >= 4 and order.count("b") >= 4, order  # they alternate


async def test_one_tenant_alone_gets_everything(redis: Redis, settings: Settings) -> None:
    """Work-conserving: a fetch takes as much as it asks for while anything waits, in order."""
    adm, c = admission(redis, settings), await ready_consumer(redis, settings)
    sent = [request("solo") for _ in range(25)]
    for m in sent:
        await adm.submit(m, max_queued=1000)
    assert await queued_len(redis) == 25 and await redis.xlen(LANE) == 1  # the first went straight on
    got = []
    while len(got) < 25:
        batch = await c.fetch(4, 10)
        assert len(batch) == min(4, 25 - len(got))
        got += batch
    assert [d.message.id for d in got] == [m.id for m in sent]
    assert await backlog(redis) == {} and await redis.exists(keys.staged(LANE, "solo")) == 0


async def test_nothing_waiting_goes_straight_onto_the_lane(redis: Redis, settings: Settings) -> None:
    """With an idle worker, each request goes onto the lane at once (a blocked read wakes), and
    is charged there."""
    adm, c = admission(redis, settings), await ready_consumer(redis, settings)
    for tenant in ("a", "b", "a"):
        m = request(tenant)
        await adm.submit(m, max_queued=100)
        assert await backlog(redis) == {}
        (d,) = await c.fetch(1, 10)
        assert d.message.id == m.id and d.stream == LANE
        await run_and_commit(c, d, 16)
    counters = await redis.hgetall(keys.counters(LANE))
    assert float(counters["a"]) > float(counters["b"]) > 0


async def test_the_final_corrects_the_charge(redis: Redis, settings: Settings) -> None:
    adm, c = admission(redis, settings), await ready_consumer(redis, settings)
    m = request("a", prompt_chars=40, max_tokens=50)
    await adm.submit(m, max_queued=100, share=TenantShare(weight=2.0))
    assert float(await redis.hget(keys.counters(LANE), "a")) == expected_cost(m) / 2  # 10 + 2 x 50, halved
    (d,) = await c.fetch(1, 10)
    await run_and_commit(c, d, 5)
    assert float(await redis.hget(keys.counters(LANE), "a")) == (10 + 2 * 5) / 2
    assert await redis.hget(KEYS.status(m.id), "charged") is None  # settled once


# -- the share of the queue bound ---------------------------------------------------------------

async def test_a_tenant_cannot_exceed_its_share_while_another_has_work(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    await adm.submit(request("b"), max_queued=10)
    for _ in range(5):  # half of 10
        await adm.submit(request("a"), max_queued=10)
    with pytest.raises(TenantQueueFull):
        await adm.submit(request("a"), max_queued=10)
    with pytest.raises(TenantQueueFull):  # a call of several is refused whole
        await adm.submit_many([request("a"), request("a")], max_queued=10)
    for _ in range(4):  # b is admitted while a is refused
        await adm.submit(request("b"), max_queued=10)
    for _ in range(5):  # the bound (10) is full, yet a third tenant gets its share past it...
        await adm.submit(request("c"), max_queued=10)
    with pytest.raises(QueueFull):  # ...up to the bound plus one share, whoever asks
        await adm.submit(request("d"), max_queued=10)
    assert await redis.hgetall(keys.held(LANE)) == {"a": "5", "b": "5", "c": "5"}


async def test_a_tenant_that_filled_the_bound_alone_does_not_refuse_another(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    for _ in range(10):  # alone, a may take all of it
        await adm.submit(request("a"), max_queued=10)
    with pytest.raises(QueueFull):
        await adm.submit(request("a"), max_queued=10)
    for _ in range(5):  # b still gets its share (past the model's bound, by at most that share)
        await adm.submit(request("b"), max_queued=10)
    with pytest.raises(TenantQueueFull):
        await adm.submit(request("b"), max_queued=10)
    with pytest.raises(TenantQueueFull):  # and a, over its share, waits for its entries to drain
        await adm.submit(request("a"), max_queued=10)
    c = await ready_consumer(redis, settings)
    for _ in range(15):
        (d,) = await c.fetch(1, 10)
        await run_and_commit(c, d, 1)
    assert await redis.exists(keys.held(LANE)) == 0  # every count back to none: nothing drifted
    await adm.submit(request("a"), max_queued=10)


async def test_a_queue_share_is_per_tenant(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    await adm.submit(request("b"), max_queued=10)
    for _ in range(8):
        await adm.submit(request("big"), max_queued=10, share=TenantShare(queue_share=0.8))
    with pytest.raises(TenantQueueFull):
        await adm.submit(request("big"), max_queued=10, share=TenantShare(queue_share=0.8))


async def test_a_bad_tenant_name_is_refused(redis: Redis, settings: Settings) -> None:
    with pytest.raises(ValueError, match="tenant"):
        await admission(redis, settings).submit(request("a:b"), max_queued=10)


# -- staged requests are requests like any other ------------------------------------------------

async def staged_pair(redis: Redis, settings: Settings, **kw) -> tuple[Admission, RequestMessage, RequestMessage]:
    """Two requests of tenant a: the first straight onto the lane, the second staged."""
    adm = admission(redis, settings)
    first, second = request("a"), request("a", **kw)
    await adm.submit(first, max_queued=10)
    await adm.submit(second, max_queued=10)
    assert (await statuses(redis, settings).status(MODEL, second.id)).state == State.QUEUED
    assert await redis.hget(KEYS.status(second.id), "stream") == keys.staged(LANE, "a")
    return adm, first, second


async def test_a_staged_request_is_cancelled_at_once(redis: Redis, settings: Settings) -> None:
    adm, first, second = await staged_pair(redis, settings)
    assert await cancels(redis, settings).cancel(MODEL, second.id) == "cancelled"
    assert await redis.exists(keys.staged(LANE, "a")) == 0 and await backlog(redis) == {}
    assert await redis.hgetall(keys.held(LANE)) == {"a": "1"}
    c = await ready_consumer(redis, settings)
    assert [d.message.id for d in await c.fetch(4, 10)] == [first.id]  # the cancelled one never runs


async def test_a_dispatched_request_is_cancelled_on_the_lane(redis: Redis, settings: Settings) -> None:
    adm, first, second = await staged_pair(redis, settings)
    c = await ready_consumer(redis, settings)
    (d1,) = await c.fetch(1, 10)
    await run_and_commit(c, d1, 1)
    (d2,) = await c.fetch(1, 10)  # dispatched: its status names its lane entry now
    assert await redis.hmget(KEYS.status(second.id), "stream", "entry") == [LANE, d2.entry_id]
    assert await cancels(redis, settings).cancel(MODEL, second.id) == "cancelled"
    assert await c.start(d2) == "final"
    assert await redis.exists(keys.held(LANE)) == 0


async def test_a_staged_request_past_its_deadline_expires(redis: Redis, settings: Settings) -> None:
    adm, first, second = await staged_pair(redis, settings, deadline_in=-1)
    expired = await expire_overdue(redis, Scripts(redis), KEYS, [LANE, KEYS.bulk], now=time.time(),
                                   lease_timeout_s=30.0, result_ttl_s=3600, reply_ttl_s=60)
    assert expired == [second.id]
    assert (await statuses(redis, settings).status(MODEL, second.id)).state == State.EXPIRED
    assert await redis.exists(keys.staged(LANE, "a")) == 0 and await redis.hgetall(keys.held(LANE)) == {"a": "1"}


async def test_lanes_are_shared_out_on_their_own(redis: Redis, settings: Settings) -> None:
    """Fairness is per lane: the bulk lane's tenants have counters of their own, and the
    interactive reserve still holds (bulk reads leave reserved slots)."""
    adm, c = admission(redis, settings), await ready_consumer(redis, settings)
    c.configure(reserves=SlotReserves(interactive=1))
    for tenant in ("a", "b"):
        for _ in range(3):
            await adm.submit(request(tenant, lane="bulk"), max_queued=100)
    got = await c.fetch(4, 10)
    assert len(got) == 3 and all(d.stream == KEYS.bulk for d in got)  # 4 less the reserved slot
    assert sorted(d.message.tenant for d in got) == ["a", "a", "b"]
    assert await redis.exists(keys.counters(LANE)) == 0 and await redis.exists(keys.counters(KEYS.bulk)) == 1


async def test_a_worker_killed_holding_dispatched_requests_loses_nothing(redis: Redis, settings: Settings) -> None:
    """Dispatched entries are lane entries: a dead worker's are reclaimed and each ends once."""
    adm = admission(redis, settings)
    sent = [request(t) for t in ("a", "b") for _ in range(4)]
    for m in sent:
        await adm.submit(m, max_queued=100)
    dead = await ready_consumer(redis, settings, "dead")
    held = await dead.fetch(5, 10)
    for d in held:
        assert await dead.start(d) == "run"
        await redis.xclaim(d.stream, "workers", d.consumer, 0, [d.entry_id], idle=10_000_000, justid=True)
    alive = await ready_consumer(redis, settings, "alive")
    done = []
    while len(done) < len(sent):
        batch = await alive.fetch(8, 10)
        assert batch, done
        for d in batch:
            await run_and_commit(alive, d, 1)
            done.append(d.message.id)
    assert sorted(done) == sorted(m.id for m in sent)  # each once
    for d in held:  # the dead worker's late commit is fenced
        assert await dead.commit(d, finished(d, 1)) is False
    assert await redis.exists(keys.held(LANE)) == 0


async def test_the_tenant_reserve_keeps_a_slot_for_a_light_tenant(redis: Redis, settings: Settings) -> None:
    """A worker of 4 slots, 1 reserved: while b is active, a (flooding) fills 3; b's next request
    goes straight onto the lane and starts in the reserved slot at once. Once b is idle past
    ACTIVE_S, a takes every slot (work-conserving)."""
    adm, c = admission(redis, settings), await ready_consumer(redis, settings)
    c.configure(reserves=SlotReserves(capacity=4, tenant=1))
    await adm.submit(request("b"), max_queued=100)
    (d,) = await c.fetch(4, 10)
    await run_and_commit(c, d, 1)
    for _ in range(10):
        await adm.submit(request("a"), max_queued=100)
    got = await c.fetch(4, 10)
    assert [d.message.tenant for d in got] == ["a"] * 3  # the fourth slot waits for another tenant
    assert await c.fetch(1, 10) == []
    light = request("b")
    await adm.submit(light, max_queued=100)
    assert await redis.hget(KEYS.status(light.id), "stream") == LANE  # served next anyway: no staging
    (d,) = await c.fetch(1, 10)
    assert d.message.id == light.id
    await redis.hset(keys.counters(LANE), "@b", time.time() - keys.ACTIVE_S - 1)  # b idle since
    await run_and_commit(c, d, 1)
    (d,) = await c.fetch(1, 10)
    assert d.message.tenant == "a"


async def test_a_worker_keeping_its_reserve_reads_again_soon(redis: Redis, settings: Settings) -> None:
    """Its own requests ending free slots that a heavy tenant's staged requests may fill: its
    blocking read, while its free slots are within the reserve, is short (not the poll's 500 ms)."""
    c = await ready_consumer(redis, settings)
    c.configure(reserves=SlotReserves(capacity=8, tenant=2))
    assert c.reads.blocking_ms(2, 500) == RESERVE_BLOCK_MS and c.reads.blocking_ms(3, 500) == 500
    c.configure(reserves=SlotReserves(capacity=8, tenant=0))
    assert c.reads.blocking_ms(1, 500) == 500


async def test_the_reserve_shares_a_worker_by_weight(redis: Redis, settings: Settings) -> None:
    """Two flooding tenants weighted 3 : 1 on a worker whose free slots are always within its
    reserve (one frees at a time): the reserve's parts follow the weights, so they run 3 : 1."""
    adm, c = admission(redis, settings), await ready_consumer(redis, settings)
    c.configure(reserves=SlotReserves(capacity=8, tenant=7))
    shares = {"heavy": TenantShare(weight=3.0), "light": TenantShare(weight=1.0)}
    for _ in range(60):
        for tenant, share in shares.items():
            await adm.submit(request(tenant), max_queued=10_000, share=share)
    running = await c.fetch(8, 10)
    for _ in range(40):  # one ends, one starts
        await run_and_commit(c, running.pop(0), 16)
        running += await c.fetch(1, 10)
    assert sorted(d.message.tenant for d in running) == ["heavy"] * 6 + ["light"] * 2
