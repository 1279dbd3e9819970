"""The webhook outbox (broker/webhooks/outbox.py, lua/_lib.lua's append_event): every final of a request
whose owner has an endpoint appends exactly one event to its slot's outbox, in the script that
writes the final; a request of an owner without one appends nothing and costs no command more."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
from redis.asyncio import Redis

from sluice.broker.jobs.store import JobStore
from sluice.broker.plumbing.connection import is_cluster
from sluice.broker.webhooks import outbox as webhooks
from sluice.broker.webhooks.endpoints import EndpointStore
from sluice.broker.webhooks.outbox import OWNERS, batch_outbox, outbox
from sluice.config.settings import Settings
from tests.broker.helpers import KEYS, admission, cancels, done_result, fetch_one, message, ready_consumer
from tests.broker.test_expiry import sweep

OWNER = "ab" * 32


async def events(redis: Redis) -> list[dict]:
    return [f for _, f in await redis.xrange(outbox(KEYS))]


async def subscribed(redis: Redis, settings: Settings, owner: str = OWNER):
    await redis.hset(OWNERS, owner, 1)
    return admission(redis, settings)


async def submit(adm, *, owner: str | None = OWNER, **kw):
    m = message(**kw).model_copy(update={"owner": owner})
    await adm.submit(m, max_queued=1000)
    return m


async def test_a_commit_appends_one_event_only_for_a_subscribed_owner(redis: Redis, settings: Settings) -> None:
    adm = await subscribed(redis, settings)
    hooked, plain = await submit(adm), await submit(adm, owner="cd" * 32)
    assert await redis.hget(KEYS.status(hooked.id), "hook") == "1"
    assert await redis.hget(KEYS.status(plain.id), "hook") is None
    c = await ready_consumer(redis, settings)
    for _ in range(2):
        d = await fetch_one(c)
        assert await c.start(d) == "run"
        assert await c.commit(d, done_result()) is True
        assert await c.commit(d, done_result()) is False  # a re-sent commit writes no second final
    (ev,) = await events(redis)
    assert ev["id"] == hooked.id and ev["state"] == "done" and ev["owner"] == OWNER and ev["model"] == KEYS.model
    assert float(ev["at"]) <= time.time()


async def test_cancel_expire_and_dead_letter_each_append_their_final(redis: Redis, settings: Settings) -> None:
    adm = await subscribed(redis, settings)
    cancelled = await submit(adm)
    cancel = cancels(redis, settings).cancel
    assert await cancel(KEYS.model, cancelled.id) == "cancelled"
    assert await cancel(KEYS.model, cancelled.id) == "cancelled"  # final already: no second event
    expired = await submit(adm, deadline_in=-1)
    assert await sweep(redis, now=time.time()) == [expired.id]
    failed = await submit(adm)
    c = await ready_consumer(redis, settings)
    d = await fetch_one(c)
    assert await c.dead_letter(d.stream, d.entry_id, failed.id, d.message.model_dump_json(), "boom", 3, d.message)
    assert [(e["id"], e["state"]) for e in await events(redis)] == [
        (cancelled.id, "cancelled"), (expired.id, "expired"), (failed.id, "failed")]


async def test_a_dead_letter_whose_status_expired_keeps_its_event(redis: Redis, settings: Settings) -> None:
    """dead_letter.lua re-creates a status that expired (or was lost) before its final: the
    re-created one carries the webhook mark when the owner has an endpoint, so the failed final
    still appends its event; an owner without one still gets none."""
    adm = await subscribed(redis, settings)
    hooked, plain = await submit(adm), await submit(adm, owner="cd" * 32)
    c = await ready_consumer(redis, settings)
    for d in await c.fetch(2, 1000):
        await redis.delete(KEYS.status(d.message.id))  # its status expired while it ran
        assert await c.dead_letter(d.stream, d.entry_id, d.message.id, d.message.model_dump_json(), "boom", 3,
                                   d.message)
        assert await redis.hget(KEYS.status(d.message.id), "state") == "failed"
    assert [(e["id"], e["state"], e["owner"]) for e in await events(redis)] == [(hooked.id, "failed", OWNER)]
    assert await redis.hget(KEYS.status(plain.id), "hook") is None


async def test_a_start_that_finds_the_request_cancelled_appends_the_cancel(redis: Redis, settings: Settings) -> None:
    adm = await subscribed(redis, settings)
    m = await submit(adm)
    c = await ready_consumer(redis, settings)
    d = await fetch_one(c)  # fetched, then cancelled while queued: the cancel is its final
    assert await cancels(redis, settings).cancel(KEYS.model, m.id) == "cancelled"
    assert await c.start(d) == "final"
    assert [(e["id"], e["state"]) for e in await events(redis)] == [(m.id, "cancelled")]


async def test_bulk_rows_and_owners_without_endpoints_append_nothing(redis: Redis, settings: Settings) -> None:
    adm = await subscribed(redis, settings)
    await submit(adm, lane="bulk")
    await submit(adm, owner=None)  # no keys: the anonymous owner '' has no endpoint here
    c = await ready_consumer(redis, settings)
    for d in await c.fetch(2, 1000):
        assert await c.start(d) == "run"
        assert await c.commit(d, done_result()) is True
    assert await events(redis) == []


async def test_the_owners_are_read_at_most_once_per_refresh(redis: Redis, settings: Settings) -> None:
    owners = webhooks.SubscribedOwners(redis, refresh_s=3600)
    assert not await owners.has(OWNER)
    await redis.hset(OWNERS, OWNER, 1)
    assert not await owners.has(OWNER)  # cached: no read per request
    owners.refresh_s = 0
    assert await owners.has(OWNER)


async def test_a_request_admitted_once_an_endpoint_creation_returned_is_always_marked(redis: Redis,
                                                                                     settings: Settings) -> None:
    """Adversarial: one api process read the owners just before the endpoint's write, another
    re-reads them at every moment around it; a request is admitted through each the moment the
    creation returns, twelve times over. Every one carries the mark (its final has its event)."""
    first, second, store = admission(redis, settings), admission(redis, settings), EndpointStore(redis)
    stop = asyncio.Event()

    async def churn() -> None:  # the second api's list is read at arbitrary moments
        while not stop.is_set():
            await second.webhook_owners.has("nobody")
            await asyncio.sleep(0.005)

    task = asyncio.create_task(churn())
    try:
        for i in range(12):
            owner = f"{i:064x}"
            before = await submit(first, owner=owner)  # read its owners now: without this one
            await store.create("http://127.0.0.1:9/hooks", [], owner=owner)
            for adm in (first, second):
                m = await submit(adm, owner=owner)
                assert await redis.hget(KEYS.status(m.id), "hook") == "1", f"round {i}: admitted unmarked"
            assert await redis.hget(KEYS.status(before.id), "hook") is None
    finally:
        stop.set()
        await task


async def test_a_batch_final_appends_its_event_to_its_own_outbox(redis: Redis, settings: Settings) -> None:
    await redis.hset(OWNERS, OWNER, 1)
    jobs = JobStore(redis)
    done = await jobs.create("file-x", "/v1/completions", "24h", None, owner=OWNER)
    plain = await jobs.create("file-x", "/v1/completions", "24h", None, owner="cd" * 32)
    for job in (done, plain):
        assert await jobs.move(job["id"], "in_progress", ["validating"]) == "in_progress"
        assert await jobs.move(job["id"], "completed", ["in_progress"]) == "completed"
        assert await jobs.move(job["id"], "failed", ["in_progress"]) == "completed"  # refused: no event
    cancelled = await jobs.create("file-x", "/v1/completions", "24h", None, owner=OWNER)
    assert (await jobs.request_cancel(cancelled["id"]))["status"] == "cancelled"
    for job, state in ((done, "completed"), (cancelled, "cancelled")):
        (ev,) = [f for _, f in await redis.xrange(batch_outbox(job["id"]))]
        assert ev["id"] == job["id"] and ev["state"] == state and ev["owner"] == OWNER
    assert await redis.xlen(batch_outbox(plain["id"])) == 0
    assert set(await redis.zrange(webhooks.BATCHES, 0, -1)) == {done["id"], cancelled["id"]}


async def test_the_hook_costs_three_commands_and_nothing_without_an_endpoint(redis: Redis, settings: Settings) -> None:
    """One request run from admission to its final, counted in INFO commandstats (commands run
    by scripts included): an owner without an endpoint costs exactly what it cost before the
    outbox existed; one with an endpoint three more: the mark (HSET), its owner and model
    read at the final (HMGET), the event (XADD)."""
    if is_cluster(redis):
        pytest.skip("counts one server's commands")
    adm = await subscribed(redis, settings)
    adm.webhook_owners.refresh_s = 3600
    assert await adm.webhook_owners.has(OWNER)  # the cache read once, before counting
    c = await ready_consumer(redis, settings)

    async def one(owner: str) -> Counter[str]:
        await redis.config_resetstat()
        await submit(adm, owner=owner)
        d = await fetch_one(c)
        assert await c.start(d) == "run" and await c.commit(d, done_result()) is True
        stats = await redis.info("commandstats")
        # (the fetch's reads are left out: how many a fetch makes depends on its reclaim scans'
        # timing, not on the request)
        return Counter({k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items()
                        if not k.startswith(("cmdstat_info", "cmdstat_config", "cmdstat_xreadgroup",
                                             "cmdstat_xautoclaim"))})

    # A first request loads the scripts a server flushed by an earlier test lacks (its refused
    # EVALSHAs and SCRIPT LOADs are no cost of the hook): the counts are of the next two.
    await one("cd" * 32)
    plain, hooked = await one("cd" * 32), await one(OWNER)
    assert hooked - plain == Counter({"hset": 1, "hmget": 1, "xadd": 1}) and not plain - hooked
    assert await redis.xlen(outbox(KEYS)) == 1
