"""The broker's half of "exactly one visible result": one final per request whatever the
order of events, every entry ends, duplicates never run, and poison is charged alone."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from redis.asyncio import Redis

from sluice.broker.delivery.dead_letters import DeadLetters
from sluice.broker.keys import GROUP
from sluice.broker.replies.writer import ReplyWriter
from sluice.config.settings import Settings
from sluice.protocol.messages import DeltaEvent, FinalResult
from sluice.protocol.states import State
from tests.broker.helpers import (
    AFFINITY,
    KEYS,
    MODEL,
    admission,
    cancels,
    done_result,
    fetch_one,
    message,
    pending,
    ready_consumer,
    replies,
    running_request,
    submit_n,
)


def finals(entries: list[tuple[str, dict]]) -> list[dict]:
    return [json.loads(f["data"]) for _, f in entries if f.get("kind") == "final"]


async def expire_lease(redis: Redis, d, to: str = "w1") -> None:
    """Age an entry past any lease timeout, as if its worker had died."""
    await redis.xclaim(d.stream, GROUP, to, 0, [d.entry_id], idle=10_000_000, justid=True)


async def test_dead_lettering_a_cancelled_request_writes_no_second_final(redis: Redis, settings: Settings) -> None:
    adm, m, c, d = await running_request(redis, settings)
    assert await cancels(redis, settings).cancel(KEYS.model, m.id) == "cancelling"
    assert await c.commit(d, FinalResult(status=State.CANCELLED, error="cancelled by the client"))
    # the same entry, pending again by hand (the state a late dead-letter decision meets)
    await redis.xadd(KEYS.requests, m.to_fields(), id=d.entry_id.replace("-0", "-1"))
    (again,) = await c.fetch(1, 100)
    assert not await c.dead_letter(again.stream, again.entry_id, m.id, m.model_dump_json(), "crashed", 3)
    assert [f["status"] for f in finals(await replies(redis, m.id))] == ["cancelled"]
    assert await redis.hget(KEYS.status(m.id), "state") == "cancelled"
    assert await redis.xlen(KEYS.dead_letters) == 0  # `dlq retry` can never run it


async def test_no_script_overwrites_a_final(redis: Redis, settings: Settings) -> None:
    adm, m, c, d = await running_request(redis, settings)
    await redis.hset(KEYS.status(m.id), "state", "expired")  # final by another path meanwhile
    assert not await c.commit(d, FinalResult(status=State.DONE))
    assert await redis.hget(KEYS.status(m.id), "state") == "expired"
    assert finals(await replies(redis, m.id)) == []
    assert await redis.xpending(KEYS.requests, GROUP) and (await redis.xpending(KEYS.requests, GROUP))["pending"] == 0
    assert await cancels(redis, settings).cancel(KEYS.model, m.id) == "expired"
    assert finals(await replies(redis, m.id)) == []


async def test_an_unreadable_entry_fails_its_request_naming_why(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    (m,) = await submit_n(adm, 1)
    await redis.xadd(KEYS.requests, {"id": "req-garbled", "data": "{not json"})
    await redis.hset(KEYS.status("req-garbled"), mapping={"state": "queued", "enqueued_at": 1.0})
    c = await ready_consumer(redis, settings)
    got = await c.fetch(5, 100)
    assert [d.message.id for d in got] == [m.id]  # the readable one still runs
    status = await redis.hgetall(KEYS.status("req-garbled"))
    assert status["state"] == "failed"
    assert "could not be read" in json.loads(status["result"])["error"]
    assert [f["status"] for f in finals(await replies(redis, "req-garbled"))] == ["failed"]
    (letter,) = await DeadLetters(redis, KEYS.model).list()
    assert letter.request_id == "req-garbled" and letter.message is None and letter.data == "{not json"
    assert (await redis.xpending(KEYS.requests, GROUP))["pending"] == 1  # only the readable one


async def test_an_unreadable_entry_without_an_id_is_quarantined_once_and_acknowledged(
        redis: Redis, settings: Settings) -> None:
    """Nobody to tell: the raw entry goes to the dead-letter stream for the operator, once, and
    leaves the lane (acknowledged and deleted), so later fetches neither fail nor see it again."""
    adm = admission(redis, settings)
    (m,) = await submit_n(adm, 1)
    await redis.xadd(KEYS.requests, {"data": "{not json"})
    c = await ready_consumer(redis, settings)
    got = await c.fetch(5, 100)
    assert [d.message.id for d in got] == [m.id]
    assert await c.fetch(5, 100) == []  # a second fetch: nothing raised, nothing read again
    (letter,) = await DeadLetters(redis, KEYS.model).list()
    assert letter.request_id == "" and "could not be read" in letter.error
    assert json.loads(letter.data) == {"data": "{not json"}
    assert (await redis.xpending(KEYS.requests, GROUP))["pending"] == 1  # only the readable one
    assert await redis.xlen(KEYS.requests) == 1


async def test_an_entry_from_a_newer_api_with_unknown_fields_runs(redis: Redis, settings: Settings) -> None:
    """A rolling upgrade: the api writes a sampling field this worker does not know yet."""
    m = message()
    data = json.loads(m.model_dump_json())
    data["sampling"]["min_p"] = 0.1
    data["tenant"] = "acme"
    await redis.xadd(KEYS.requests, {"id": m.id, "data": json.dumps(data)})
    c = await ready_consumer(redis, settings)
    d = await fetch_one(c)
    assert d.message.id == m.id and d.message.sampling.seed == m.sampling.seed


async def test_a_rerun_admission_enqueues_nothing_twice(redis: Redis, settings: Settings) -> None:
    """redis-py re-runs a script after a dropped connection: the same request id must not
    become two entries."""
    adm = admission(redis, settings)
    m = message()
    first = await adm.submit(m, max_queued=10)
    assert await adm.submit(m, max_queued=10) == first
    assert await redis.xlen(KEYS.requests) == 1


async def test_a_duplicate_entry_of_a_request_never_runs(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    m = message()
    await adm.submit(m, max_queued=10)
    await redis.xadd(KEYS.requests, m.to_fields())  # the same request twice on the stream
    c = await ready_consumer(redis, settings)
    first, second = await c.fetch(2, 100)
    assert await c.start(first) == "run"
    assert await c.start(second) == "duplicate"
    assert await redis.xlen(KEYS.requests) == 1


async def test_a_running_request_reclaimed_after_its_worker_died_runs_again(
        redis: Redis, settings: Settings) -> None:
    adm, m, dead, d = await running_request(redis, settings, "dead")
    await expire_lease(redis, d, "dead")
    live = await ready_consumer(redis, settings, "live")
    (again,) = await live.fetch(5, 100)
    # the first retry of a crashed run goes as ordinary work (a crash beside it was not its own)
    assert (again.message.id, again.attempt, again.quarantined) == (m.id, 2, False)
    assert await live.start(again) == "run"
    assert await redis.hget(KEYS.status(m.id), "worker") == "live"
    assert not await dead.commit(d, FinalResult(status=State.DONE))  # fenced


async def test_a_crashed_batch_is_retried_together_first(redis: Redis, settings: Settings) -> None:
    """The requests of a worker that died are reclaimed all at once, ahead of new entries, and
    run as ordinary work: one extra run each (they once went one quarantine slot at a time)."""
    adm = admission(redis, settings)
    sent = await submit_n(adm, 3)
    dead = await ready_consumer(redis, settings, "dead")
    for d in await dead.fetch(3, 100):
        assert await dead.start(d) == "run"
        await expire_lease(redis, d, "dead")
    fresh = await submit_n(adm, 2)
    live = await ready_consumer(redis, settings, "live")
    again = await live.fetch(10, 100, quarantine_room=0)  # an engine busy with other work takes them too
    assert [(d.message.id, d.attempt, d.quarantined) for d in again] == [(m.id, 2, False) for m in sent]
    for d in again:
        assert await live.start(d) == "run"
        assert await live.commit(d, done_result())
    assert [d.message.id for d in await live.fetch(10, 100)] == [m.id for m in fresh]


async def crash_until_settled(redis: Redis, settings: Settings, poison: str, batch: list) -> tuple[int, int]:
    """`batch` (fetched by worker w0) runs and crashes (the poison brings down whatever runs with
    it); then worker after worker takes what is left, runs what the consumer hands out (a
    quarantine group only in an empty engine) and crashes whenever the poison is in the run.
    Returns (crashes, runs of healthy requests)."""
    w = await ready_consumer(redis, settings, "w0")
    for d in batch:
        assert await w.start(d) == "run"
        await expire_lease(redis, d, "w0")
    crashes, healthy_runs, k = 1, 0, 0
    while True:
        k += 1
        c = await ready_consumer(redis, settings, f"w{k}")
        got = await c.fetch(64, 10, quarantine_room=64)  # an empty engine: a quarantine group may go
        if not got:
            got = await c.fetch(64, 10, quarantine_room=64)  # what the first fetch parked
        if not got:
            return crashes, healthy_runs
        assert len({d.quarantined for d in got}) == 1  # a group never runs beside ordinary work
        runs = [d for d in got if await c.start(d) == "run"]
        crashed = any(d.message.id == poison for d in runs)
        for d in runs if not crashed else []:
            healthy_runs += 1
            assert await c.commit(d, done_result())
        crashes += crashed
        for d in list(c.held.values()):  # this worker died (or stops here): the next takes them over
            await expire_lease(redis, d, c.consumer)


@pytest.mark.parametrize("healthy", [1, 4, 8, 16])
async def test_a_poison_request_is_found_by_bisection_and_only_it_is_charged(
        redis: Redis, settings: Settings, healthy: int) -> None:
    """A poison request crashes its worker with `healthy` requests beside it. Retried together,
    it crashes again; the suspects are then split in halves, so the poison runs in a group of one
    after about log2(n) more crashes and is dead-lettered after its charges (crashes it
    had in a group of one); every neighbour finishes, never charged."""
    adm = admission(redis, settings)
    sent = await submit_n(adm, healthy + 1)
    poison = sent[healthy // 2].id
    w = await ready_consumer(redis, settings, "w0")
    crashes, healthy_runs = await crash_until_settled(redis, settings, poison, await w.fetch(64, 100))
    for m in sent:
        assert await redis.hget(KEYS.status(m.id), "state") == ("failed" if m.id == poison else "done")
    (letter,) = await DeadLetters(redis, KEYS.model).list()
    assert letter.request_id == poison
    # 1 crash fresh, 1 retried together, about log2(n) halvings, then max_deliveries - 1 in a group of one
    bound = 2 + math.ceil(math.log2(healthy + 1)) + settings.max_deliveries - 1
    assert crashes <= bound, (crashes, bound)
    assert healthy_runs == healthy  # each neighbour ran to its end once


async def test_a_dead_letter_retry_respects_the_bound_and_becomes_the_current_entry(
        redis: Redis, settings: Settings) -> None:
    adm, m, c, d = await running_request(redis, settings)
    await redis.hset(KEYS.status(m.id), "next:0", 5)  # tokens streamed before it failed
    assert await c.dead_letter(d.stream, d.entry_id, m.id, m.model_dump_json(), "crashed", 3)
    letters = DeadLetters(redis, KEYS.model)
    await submit_n(adm, 1)
    assert await letters.retry(None, max_queued=1) == []  # the stream is full
    assert await letters.retry(None, max_queued=10) == [m.id]
    status = await redis.hgetall(KEYS.status(m.id))
    assert status["state"] == "queued" and "charges" not in status and "next:0" not in status
    got = {x.message.id: x for x in await c.fetch(10, 100)}
    assert got[m.id].entry_id == status["entry"]
    assert await c.start(got[m.id]) == "run"


async def test_a_worker_still_running_a_retried_dead_letter_writes_nothing(
        redis: Redis, settings: Settings) -> None:
    """The worker that ran a request before it was dead-lettered is still at it when `dlq
    retry` puts it back as a new entry (the retry clears the attempt): its tokens and its commit
    are fenced by the entry, before the new entry starts and after, and the new run's final is
    the one final."""
    adm, m, c, d = await running_request(redis, settings)
    assert await c.dead_letter(d.stream, d.entry_id, m.id, m.model_dump_json(), "crashed", 3)
    assert await DeadLetters(redis, KEYS.model).retry(None, max_queued=10) == [m.id]
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.reply_ttl_s)
    writer.delta(d, DeltaEvent(i=0, text=" old", token_ids=[1]))
    await writer.flush()
    assert await c.commit(d, done_result(" old")) is False
    assert await replies(redis, m.id) == []
    w2 = await ready_consumer(redis, settings, "w2")
    (again,) = await w2.fetch(1, 100)
    assert again.entry_id != d.entry_id and await w2.start(again) == "run"
    assert await c.commit(d, done_result(" old")) is False
    assert await w2.commit(again, done_result(" new")) is True
    assert [f["status"] for f in finals(await replies(redis, m.id))] == ["done"]
    assert " new" in await redis.hget(KEYS.status(m.id), "result")


async def test_reclaim_takes_over_lapsed_leases_ahead_of_new_entries(redis: Redis, settings: Settings) -> None:
    """An entry whose lease lapsed is taken over ahead of new entries: within `reclaim_scan_s`
    of a scan that found nothing (a scan before every read cost a command a request), and
    while scans find some, at every read: a dead worker's requests go as fast as slots free."""
    adm = admission(redis, settings)
    live = await ready_consumer(redis, settings, "live")
    assert await live.fetch(1, 10) == []  # a reclaim ran just now and found nothing
    orphans = await submit_n(adm, 3)
    dead = await ready_consumer(redis, settings, "dead")
    held: list = []
    while len(held) < 3:  # (with prefix affinity on, live's groups wait their bound for it first)
        held += await dead.fetch(3 - len(held), 100)
    for d in held:
        assert await dead.start(d) == "run"
        await expire_lease(redis, d, "dead")
    fresh = await submit_n(adm, 3)
    await asyncio.sleep(live.reclaim_scan_s)
    taken = await live.fetch(4, 100)  # all at once: a crashed batch is retried together first
    # in the lane's order: the order they went onto it (with prefix affinity, not always admission's)
    assert [(d.message.id, d.attempt) for d in taken] == [(d.message.id, 2) for d in held]
    assert {d.message.id for d in held} == {m.id for m in orphans}
    got, ids = [d.message.id for d in await live.fetch(4, 100)], [m.id for m in fresh]
    # (with prefix affinity on, a worker takes its own groups first: the same entries, in its order)
    assert (sorted(got) == sorted(ids)) if AFFINITY else (got == ids)


async def test_the_status_hash_records_who_made_a_request(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    mine, anonymous = message().model_copy(update={"owner": "sha256:abc"}), message()
    for m in (mine, anonymous):
        await adm.submit(m, max_queued=10)
    assert await redis.hget(KEYS.status(mine.id), "owner") == "sha256:abc"
    assert await redis.hget(KEYS.status(anonymous.id), "owner") is None


@pytest.mark.parametrize("deadline_passed", [False, True])
async def test_a_stale_fetched_entry_never_revives_a_request_whose_status_is_gone(
        redis: Redis, settings: Settings, deadline_passed: bool) -> None:
    """The simulation's replay: a worker fetched two queued requests; one is cancelled (its
    queued entry deleted, not the worker's copy) and its cancelled result then expires. The
    worker's start of its copy found no status and took it for a fresh request: an `expired`
    final where the client had `cancelled` (deadline passed), or a run under a status without
    its model, lane and owner. Now it runs nothing and writes nothing; the other one runs."""
    adm = admission(redis, settings)
    cancelled, other = await submit_n(adm, 2)
    c = await ready_consumer(redis, settings)
    got = {d.message.id: d for d in await c.fetch(2, 100)}
    assert await cancels(redis, settings).cancel(KEYS.model, cancelled.id) == "cancelled"
    await redis.delete(KEYS.status(cancelled.id), KEYS.reply(cancelled.id))  # its result expired
    stale = got[cancelled.id]
    if deadline_passed:
        stale.message.deadline = 0.0
    assert await c.start(stale) == "final"
    assert not await redis.exists(KEYS.status(cancelled.id), KEYS.reply(cancelled.id))  # nothing revived
    assert [p["message_id"] for p in await pending(redis)] == [got[other.id].entry_id]
    assert await c.start(got[other.id]) == "run"
