"""A hot model split over `shards: K` interactive streams, each its own slot ({m:<model>:<k>}).
A request's keys live in the slot of the shard its id names; the workers read every shard;
the bound and the depth are summed over shards; a dead letter stays in its shard; lowering K
drains the shards it leaves. Run against one server and (`make test`'s second pass) a cluster."""

from __future__ import annotations

import asyncio
import time

from redis.asyncio import Redis

from sluice.broker.delivery.consumer import StreamConsumer
from sluice.broker.delivery.dead_letters import DeadLetters
from sluice.broker.delivery.lanes import shards_in_use
from sluice.broker.intake.admission import QueueFull
from sluice.broker.intake.queues import queue_figures
from sluice.broker.limits import ConsumerLimits
from sluice.broker.replies.notifications import DoneListener
from sluice.config.settings import Settings
from sluice.protocol.ids import new_request_id, request_created_at, request_shard
from tests.broker.helpers import KEYS, MODEL, admission, cancels, done_result, message, queued_len, statuses

K = 3


def on_shard(shard: int, **kw: object):
    return message(**kw).model_copy(update={"id": new_request_id(shard)})


def sharded_consumer(redis: Redis, settings: Settings, shards: int = K, name: str = "w1") -> StreamConsumer:
    return StreamConsumer(redis, MODEL, name,
                          ConsumerLimits.of(settings, lease_timeout_s=30.0, max_deliveries=2, shards=shards))


def test_a_request_id_names_its_shard() -> None:
    rid = new_request_id(2)
    assert request_shard(rid) == 2 and request_created_at(rid) is not None
    assert request_shard(new_request_id()) == 0
    assert KEYS.status(rid) == f"sluice:{{m:{MODEL}:2}}:status:{rid}"
    assert KEYS.for_request(rid).requests == f"sluice:{{m:{MODEL}:2}}:req"
    assert KEYS.for_request(rid).log == KEYS.log  # one inference log per model


async def test_every_shard_is_read_committed_and_announced(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    c = sharded_consumer(redis, settings)
    await c.ensure_groups()
    msgs = [on_shard(k % K) for k in range(2 * K)]
    for m in msgs:
        await adm.submit(m, max_queued=100, shards=K)
    for k in range(K):
        assert await queued_len(redis, KEYS.at(k).requests) == 2
    assert {lane: f.waiting for lane, f in (await queue_figures(redis, MODEL, K)).items()} == \
        {"interactive": 2 * K, "bulk": 0}

    done = DoneListener(redis, recheck_s=30)
    done.start()
    try:
        watched = [done.watch(MODEL, m.id) for m in msgs]
        futures = [w.__enter__() for w in watched]
        got = []
        deadline = time.monotonic() + 10
        while len(got) < len(msgs) and time.monotonic() < deadline:
            got += await c.fetch(10, 200)
        assert sorted(d.message.id for d in got) == sorted(m.id for m in msgs)
        await asyncio.sleep(0.3)  # the listener's subscriptions (one channel per shard)
        for d in got:
            assert d.stream == KEYS.for_request(d.message.id).requests
            assert await c.start(d) == "run"
            assert await c.commit(d, done_result())
        await asyncio.wait_for(asyncio.gather(*futures), 10)  # every shard's announcement heard
        for w in watched:
            w.__exit__(None, None, None)
    finally:
        await done.close()
    for m in msgs:
        assert (await statuses(redis, settings).status(MODEL, m.id)).state.value == "done"
        assert (await statuses(redis, settings).find_status(m.id, [MODEL])).model == MODEL
    assert all(f.entries == 0 for f in (await queue_figures(redis, MODEL, K)).values())
    assert await c.cancelled([m.id for m in msgs]) == set()
    await cancels(redis, settings).cancel(MODEL, msgs[0].id)  # final already: nothing changes


async def test_the_bound_is_shared_out_over_the_shards(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    for _ in range(2):  # max_queued 6 over 3 shards: 2 each
        await adm.submit(on_shard(1), max_queued=6, shards=K)
    try:
        await adm.submit(on_shard(1), max_queued=6, shards=K)
        raise AssertionError("shard 1 took a third request")
    except QueueFull:
        pass
    await adm.submit(on_shard(2), max_queued=6, shards=K)  # another shard has room


async def test_a_dead_letter_stays_in_its_shard_and_can_be_retried(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    c = sharded_consumer(redis, settings)
    await c.ensure_groups()
    m = on_shard(2)
    await adm.submit(m, max_queued=100, shards=K)
    (d,) = await c.fetch(1, 200)
    assert await c.dead_letter(d.stream, d.entry_id, m.id, m.model_dump_json(), "poison", 2)
    assert await redis.xlen(KEYS.at(2).dead_letters) == 1 and await redis.xlen(KEYS.dead_letters) == 0
    letters = DeadLetters(redis, MODEL, shards=K)
    assert (await letters.recent())[0] == 1
    assert [x.request_id for x in await letters.list()] == [m.id]
    assert await letters.retry([m.id], max_queued=100) == [m.id]
    assert await redis.xlen(KEYS.at(2).requests) == 1  # back on its own shard
    (again,) = await c.fetch(1, 200)
    assert again.message.id == m.id
    assert await c.cancelled([m.id]) == set()
    await cancels(redis, settings).cancel(MODEL, m.id)
    assert await c.cancelled([m.id]) == {m.id}


async def test_lowering_the_shards_drains_the_ones_left(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    late = on_shard(2)
    await adm.submit(late, max_queued=100, shards=K)
    assert await shards_in_use(redis, KEYS, 1) == 3  # shard 2 still holds a request
    c = sharded_consumer(redis, settings, shards=await shards_in_use(redis, KEYS, 1))
    await c.ensure_groups()
    got = []
    for _ in range(K + 1):  # the blocking read takes turns over the shards
        got += await c.fetch(5, 100)
    assert [d.message.id for d in got] == [late.id]
    assert await c.start(got[0]) == "run" and await c.commit(got[0], done_result())
    assert await shards_in_use(redis, KEYS, 1) == 1
    # w1 never took its name's lock and holds nothing now: it is pruned from every shard's group.
    assert await c.prune_consumers() == ["w1"]
    for k in range(K):
        assert await redis.xinfo_consumers(KEYS.at(k).requests, "workers") == []


async def test_a_lease_lapsed_on_a_shard_is_taken_over_and_the_first_worker_fenced(
        redis: Redis, settings: Settings) -> None:
    """A worker that stops renewing (crashed, or frozen past its lease) on shard 2: another
    worker reclaims the entry from that shard's stream, runs it and commits; the first one's
    late commit writes nothing. One final, in the shard's slot."""
    adm = admission(redis, settings)
    w1 = sharded_consumer(redis, settings, name="w1")
    w2 = StreamConsumer(redis, MODEL, "w2", ConsumerLimits.of(settings, lease_timeout_s=0.2, shards=K))
    await w1.ensure_groups()
    m = on_shard(2)
    await adm.submit(m, max_queued=100, shards=K)
    (first,) = await w1.fetch(1, 200)
    assert await w1.start(first) == "run"
    await asyncio.sleep(0.4)  # w1's lease lapses
    (taken,) = await w2.fetch(1, 200)
    assert (taken.message.id, taken.stream, taken.attempt) == (m.id, KEYS.at(2).requests, 2)
    assert await w2.start(taken) == "run"
    assert await w2.commit(taken, done_result(" second"))
    assert not await w1.commit(first, done_result(" first"))  # fenced: nothing written
    finals = [f for _, f in await redis.xrange(KEYS.reply(m.id)) if f["kind"] == "final"]
    assert len(finals) == 1 and " second" in finals[0]["data"]
    assert await redis.xlen(KEYS.at(2).requests) == 0
