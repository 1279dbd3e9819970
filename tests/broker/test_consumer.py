"""The stream consumer: groups and names, fetch, the start guard, commit and lease."""

from __future__ import annotations

import json
import time

from redis.asyncio import Redis

from sluice.broker.delivery.fair_share import SlotReserves
from sluice.broker.inference_log import LogBuffer
from sluice.broker.keys import GROUP
from sluice.config.settings import Settings
from sluice.protocol.messages import FinalResult
from sluice.protocol.states import State
from tests.broker.helpers import (
    KEYS,
    admission,
    assert_request_keys_expire,
    cancels,
    consumer,
    done_result,
    fetch_one,
    message,
    pending,
    ready_consumer,
    replies,
    running_request,
    submit_n,
    take_over,
)

# -- consumer groups and names ----------------------------------------------------------------


async def test_ensure_groups_is_idempotent_and_starts_at_the_beginning(
        redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    (m,) = await submit_n(adm, 1)  # enqueued before any worker created the group
    c = consumer(redis, settings)
    await c.ensure_groups()
    await c.ensure_groups()
    for stream in (KEYS.requests, KEYS.bulk):
        groups = await redis.xinfo_groups(stream)
        assert [g["name"] for g in groups] == [GROUP]
    assert [d.message.id for d in await c.fetch(5, 100)] == [m.id]


async def test_claim_name_takes_the_next_free_suffix(redis: Redis, settings: Settings) -> None:
    a, b, c = (consumer(redis, settings, "gpu0") for _ in range(3))
    assert await a.claim_name(10) == "gpu0"
    assert await b.claim_name(10) == "gpu0-1"
    assert await c.claim_name(10) == "gpu0-2"
    assert (a.consumer, b.consumer, c.consumer) == ("gpu0", "gpu0-1", "gpu0-2")
    assert await redis.pttl(KEYS.consumer_lock("gpu0")) > 0
    await a.release_name()
    again = consumer(redis, settings, "gpu0")
    assert await again.claim_name(10) == "gpu0"


async def test_release_name_leaves_another_holders_lock(redis: Redis, settings: Settings) -> None:
    a = consumer(redis, settings, "gpu0")
    assert await a.claim_name(10) == "gpu0"
    impostor = consumer(redis, settings, "gpu0")  # same name, never claimed it
    await impostor.release_name()
    assert await redis.exists(KEYS.consumer_lock("gpu0")) == 1


# -- fetch ------------------------------------------------------------------------------------


async def test_fetch_returns_at_most_count_in_order(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    sent = [m.id for m in await submit_n(adm, 5)]
    c = await ready_consumer(redis, settings)
    batches = [await c.fetch(2, 100) for _ in range(4)]
    assert [len(b) for b in batches] == [2, 2, 1, 0]
    got = [d.message.id for b in batches for d in b]
    assert got == sent
    assert all(d.attempt == 1 for b in batches for d in b)
    assert await c.fetch(0, 100) == []


async def test_fetch_takes_interactive_before_bulk(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    bulk = [m.id for m in await submit_n(adm, 2, lane="bulk")]
    interactive = [m.id for m in await submit_n(adm, 2)]
    c = await ready_consumer(redis, settings)
    first = await c.fetch(4, 100)
    assert [d.message.id for d in first] == interactive
    assert all(d.stream == KEYS.requests for d in first)
    second = await c.fetch(4, 100)
    assert [d.message.id for d in second] == bulk
    assert all(d.stream == KEYS.bulk for d in second)


async def test_the_bulk_lane_leaves_the_reserved_slots_to_interactive_work(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    await submit_n(adm, 10, lane="bulk")
    c = await ready_consumer(redis, settings)
    c.configure(reserves=SlotReserves(interactive=1))
    assert await c.fetch(1, 50) == []  # the one free slot is the reserved one
    assert len(await c.fetch(4, 50)) == 3
    interactive = [m.id for m in await submit_n(adm, 2)]
    assert [d.message.id for d in await c.fetch(2, 50)] == interactive  # interactive work takes any slot


async def test_a_restarted_consumer_rereads_its_pending_entries_once(
        redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    sent = [m.id for m in await submit_n(adm, 3)]
    before = await ready_consumer(redis, settings, "w1")
    assert [d.message.id for d in await before.fetch(3, 100)] == sent
    later = await submit_n(adm, 1)

    after = await ready_consumer(redis, settings, "w1")  # the same worker, restarted
    again = await after.fetch(2, 100, quarantine_room=2)
    again += await after.fetch(2, 100, quarantine_room=2)
    assert [d.message.id for d in again] == sent
    assert all(d.attempt == 2 and not d.quarantined for d in again)  # a first retry: ordinary work
    # then new entries, and never the old ones a second time
    rest = await after.fetch(10, 100)
    assert [d.message.id for d in rest] == [later[0].id]
    assert rest[0].attempt == 1
    assert await after.fetch(10, 100) == []


async def test_another_consumer_does_not_see_foreign_pending_entries(
        redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    await submit_n(adm, 2)
    w1 = await ready_consumer(redis, settings, "w1")
    assert len(await w1.fetch(2, 100)) == 2
    w2 = await ready_consumer(redis, settings, "w2")
    assert await w2.fetch(5, 100) == []


# -- start (the guard) ------------------------------------------------------------------------


async def test_start_marks_the_request_running(redis: Redis, settings: Settings) -> None:
    adm, m, c, d = await running_request(redis, settings)
    status = await redis.hgetall(KEYS.status(m.id))
    assert status["state"] == "running"
    assert status["worker"] == "w1"
    assert status["attempt"] == "1"
    assert await redis.ttl(KEYS.status(m.id)) > 0
    assert await redis.xlen(KEYS.requests) == 1  # still there until committed
    assert [p["consumer"] for p in await pending(redis)] == ["w1"]


async def _assert_finished_by_guard(redis: Redis, rid: str, state: str) -> None:
    events = await replies(redis, rid)
    assert len(events) == 1
    assert events[0][1]["kind"] == "final"
    final = FinalResult.model_validate_json(events[0][1]["data"])
    assert final.status.value == state
    assert final.error
    status = await redis.hgetall(KEYS.status(rid))
    assert status["state"] == state
    assert FinalResult.model_validate_json(status["result"]) == final
    assert await redis.xlen(KEYS.requests) == 0
    assert await pending(redis) == []
    await assert_request_keys_expire(redis)


async def test_start_skips_a_request_cancelled_while_it_ran_elsewhere(redis: Redis, settings: Settings) -> None:
    # Cancelled while running on a worker that then died: the worker taking it over reads the
    # cancel from the status hash at its start, and ends it without running it.
    adm = admission(redis, settings)
    (m,) = await submit_n(adm, 1)
    dead = await ready_consumer(redis, settings, "dead")
    d = await fetch_one(dead)
    assert await dead.start(d) == "run"
    assert await cancels(redis, settings).cancel(KEYS.model, m.id) == "cancelling"
    await redis.xclaim(d.stream, GROUP, "dead", 0, [d.entry_id], idle=10_000_000, justid=True)  # its lease lapses
    c = await ready_consumer(redis, settings, "live")
    (again,) = await c.fetch(1, 100)
    assert again.attempt == 2 and await c.start(again) == "cancelled"
    await _assert_finished_by_guard(redis, m.id, "cancelled")


async def test_start_skips_an_expired_request(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    m = message(deadline_in=-1.0)
    await adm.submit(m, max_queued=10)
    c = await ready_consumer(redis, settings)
    d = await fetch_one(c)
    assert await c.start(d) == "expired"
    await _assert_finished_by_guard(redis, m.id, "expired")


async def test_start_is_fenced_once_a_later_attempt_started(redis: Redis, settings: Settings) -> None:
    """A worker frozen between its fetch and its start, past its lease: another took the entry
    over and started it. The late start writes nothing and acknowledges nothing."""
    adm = admission(redis, settings)
    (m,) = await submit_n(adm, 1)
    c = await ready_consumer(redis, settings)
    d = await fetch_one(c)
    await take_over(redis, settings, d)
    assert await c.start(d) == "fenced"
    assert await redis.hmget(KEYS.status(m.id), ["state", "attempt", "worker"]) == ["running", "2", "w2"]
    assert await replies(redis, m.id) == []
    assert [p["consumer"] for p in await pending(redis)] == ["w2"]


async def test_a_redelivered_start_is_fenced_where_the_entry_is_another_consumers(
        redis: Redis, settings: Settings) -> None:
    """A reclaimed entry (attempt > 1) is started only while it is still pending here: a
    second takeover that raced the first one wins before either started."""
    _, m, c, d = await running_request(redis, settings)
    await redis.xclaim(d.stream, GROUP, d.consumer, 0, [d.entry_id], idle=10_000_000, justid=True)
    w2 = await ready_consumer(redis, settings, "w2")
    (again,) = await w2.fetch(1, 100)
    await redis.xclaim(d.stream, GROUP, "w3", 0, [d.entry_id], justid=True)  # w3 reclaimed it meanwhile
    assert await w2.start(again) == "fenced"
    assert await redis.hget(KEYS.status(m.id), "attempt") == "1"


async def test_a_claim_not_yet_started_leaves_the_first_worker_its_commit(
        redis: Redis, settings: Settings) -> None:
    """Fencing is by attempt: an entry reclaimed but not yet started is still the first
    worker's to finish (its result is whole); the claimer's start then finds the entry no
    longer pending and runs nothing. Exactly one final either way."""
    _, m, c, d = await running_request(redis, settings)
    await redis.xclaim(d.stream, GROUP, d.consumer, 0, [d.entry_id], idle=10_000_000, justid=True)
    w2 = await ready_consumer(redis, settings, "w2")
    (again,) = await w2.fetch(1, 100)
    assert again.attempt == 2
    assert await c.commit(d, done_result()) is True
    assert await w2.start(again) == "fenced"  # the commit acknowledged and deleted its entry
    assert len([e for e in await replies(redis, m.id) if e[1].get("kind") == "final"]) == 1
    assert await redis.hget(KEYS.status(m.id), "state") == "done"
    assert (await redis.xpending(KEYS.requests, GROUP))["pending"] == 0


async def test_start_renews_the_status_ttl_only_where_the_wait_ate_half_of_it(
        redis: Redis, settings: Settings) -> None:
    """Admission gives the status status_ttl; a start after a short wait leaves it (one EXPIRE
    less a request), one after a wait longer than half of it renews it: a request that waited
    long in the queue never loses its status while it runs."""
    settings = settings.model_copy(update={"status_ttl_s": 4})
    adm = admission(redis, settings)
    quick, slow = await submit_n(adm, 2)
    c = await ready_consumer(redis, settings)
    first, second = await c.fetch(2, 100)
    await redis.expire(KEYS.status(quick.id), 3)  # a marker: a renewal would put it back to 4
    assert await c.start(first) == "run"
    assert await redis.ttl(KEYS.status(quick.id)) == 3
    await redis.hset(KEYS.status(slow.id), "enqueued_at", time.time() - 3)  # waited 3 s of its 4
    await redis.expire(KEYS.status(slow.id), 1)
    assert await c.start(second) == "run"
    assert await redis.ttl(KEYS.status(slow.id)) == 4


async def test_start_skips_an_already_final_request(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    (m,) = await submit_n(adm, 1)
    w1 = await ready_consumer(redis, settings, "w1")
    d = await fetch_one(w1)
    assert await w1.start(d) == "run"
    assert await w1.commit(d, done_result())
    # a stale copy of the same request (e.g. redelivered before the commit) is not run again
    await redis.xadd(KEYS.requests, m.to_fields())
    w2 = await ready_consumer(redis, settings, "w2")
    d2 = await fetch_one(w2)
    assert await w2.start(d2) == "final"
    assert await redis.xlen(KEYS.requests) == 0
    assert await pending(redis) == []
    assert len(await replies(redis, m.id)) == 1


# -- commit -----------------------------------------------------------------------------------


async def test_commit_writes_the_final_and_removes_the_entry(redis: Redis, settings: Settings) -> None:
    adm, m, c, d = await running_request(redis, settings)
    result = done_result()
    assert await c.commit(d, result) is True

    events = await replies(redis, m.id)
    assert [f["kind"] for _, f in events] == ["final"]
    assert FinalResult.model_validate_json(events[0][1]["data"]) == result
    status = await redis.hgetall(KEYS.status(m.id))
    assert status["state"] == "done"
    assert FinalResult.model_validate_json(status["result"]) == result
    assert 0 < await redis.ttl(KEYS.reply(m.id)) <= settings.reply_ttl_s
    assert 0 < await redis.ttl(KEYS.status(m.id)) <= settings.status_ttl_s
    assert await redis.xlen(KEYS.requests) == 0
    assert await pending(redis) == []
    await assert_request_keys_expire(redis)


async def test_the_inference_log_keeps_records_in_order(redis: Redis, settings: Settings) -> None:
    c = await ready_consumer(redis, settings)
    records = [{"rid": "req-a", "row": 0}, {"rid": "req-b", "row": 0}, {"rid": "req-a", "row": 1}]
    await c.append_log(records[:2])
    await c.append_log(records[2:])
    await c.append_log([])
    logged = [json.loads(f["data"]) for _, f in await redis.xrange(KEYS.log)]
    assert logged == records


async def test_the_worker_s_log_buffer_writes_batches_together_and_drops_on_failure(
        redis: Redis, settings: Settings, caplog) -> None:
    c = await ready_consumer(redis, settings)
    buffer = LogBuffer(c.append_log, max_records=3)
    buffer.add([{"rid": "req-a"}, {"rid": "req-b"}])
    buffer.add([{"rid": "req-c"}, {"rid": "req-d"}])  # over the bound: the oldest goes
    assert [json.loads(f["data"]) for _, f in await redis.xrange(KEYS.log)] == []  # not before a flush
    await buffer.flush()
    await buffer.flush()  # nothing left: nothing written twice
    assert [json.loads(f["data"])["rid"] for _, f in await redis.xrange(KEYS.log)] == ["req-b", "req-c", "req-d"]

    async def away(_: list[dict]) -> None:
        raise ConnectionError("Redis is away")

    failing = LogBuffer(away)
    failing.add([{"rid": "req-e"}])
    await failing.flush()  # the log is for operators: never a request's failure
    assert "1 record(s) dropped" in caplog.text


async def test_commit_by_a_fenced_out_consumer_writes_nothing(redis: Redis, settings: Settings) -> None:
    adm, m, c, d = await running_request(redis, settings)
    await take_over(redis, settings, d)
    assert await c.commit(d, done_result()) is False
    assert await replies(redis, m.id) == []
    assert await redis.exists(KEYS.reply(m.id)) == 0
    assert await redis.hget(KEYS.status(m.id), "state") == "running"
    assert await redis.xlen(KEYS.requests) == 1
    assert [p["consumer"] for p in await pending(redis)] == ["w2"]


async def test_a_second_commit_of_the_same_entry_writes_nothing(redis: Redis, settings: Settings) -> None:
    adm, m, c, d = await running_request(redis, settings)
    assert await c.commit(d, done_result())
    assert await c.commit(d, done_result("other")) is False
    assert len(await replies(redis, m.id)) == 1


# -- lease ------------------------------------------------------------------------------------


async def test_waiting_entries_are_leased_from_fetch_to_commit(redis: Redis, settings: Settings) -> None:
    """An entry fetched but not started yet (waiting in a dynamic batch) is leased too, so a
    batch longer than the lease never hands a worker its own waiting entries again."""
    adm = admission(redis, settings)
    await submit_n(adm, 2)
    c = await ready_consumer(redis, settings, "w1")
    ds = await c.fetch(2, 100)
    ids = [d.entry_id for d in ds]
    await redis.xclaim(KEYS.requests, GROUP, "w1", 0, ids, idle=100_000, justid=True)
    assert await c.lease_held() == []
    assert all(p["time_since_delivered"] < 50_000 for p in await pending(redis))
    assert await c.fetch(2, 100) == []  # nothing idle to reclaim, nothing new
    assert await c.start(ds[0]) == "run"  # (a commit writes under the token its start took)
    assert await c.commit(ds[0], FinalResult(status=State.DONE))
    assert set(c.held) == {(KEYS.requests, ids[1])}  # committed: no longer leased


async def test_lease_refreshes_own_entries_and_reports_lost_ones(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    await submit_n(adm, 3)
    c = await ready_consumer(redis, settings, "w1")
    ds = await c.fetch(3, 100)
    for d in ds:
        assert await c.start(d) == "run"
    ids = [d.entry_id for d in ds]
    # age every entry by 100 s (keeping its owner), then hand the middle one to w2
    await redis.xclaim(KEYS.requests, GROUP, "w1", 0, ids, idle=100_000, justid=True)
    await redis.xclaim(KEYS.requests, GROUP, "w2", 0, [ids[1]], idle=100_000, justid=True)

    assert [d.entry_id for d in await c.lease_held()] == [ids[1]]
    assert set(c.held) == {(KEYS.requests, ids[0]), (KEYS.requests, ids[2])}  # the lost one is let go

    by_id = {p["message_id"]: p for p in await pending(redis)}
    assert by_id[ids[1]]["consumer"] == "w2"  # not stolen back
    assert by_id[ids[1]]["time_since_delivered"] >= 100_000  # and left alone
    for eid in (ids[0], ids[2]):
        assert by_id[eid]["consumer"] == "w1"
        assert by_id[eid]["time_since_delivered"] < 50_000  # refreshed


async def test_lease_reports_an_entry_no_longer_pending(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    await submit_n(adm, 1)
    c = await ready_consumer(redis, settings)
    d = await fetch_one(c)
    await redis.xack(KEYS.requests, GROUP, d.entry_id)
    assert [x.entry_id for x in await c.lease_held()] == [d.entry_id]
    assert await pending(redis) == []


async def test_lease_covers_both_lanes(redis: Redis, settings: Settings) -> None:
    adm = admission(redis, settings)
    await submit_n(adm, 1)
    await submit_n(adm, 1, lane="bulk")
    c = await ready_consumer(redis, settings)
    ds = await c.fetch(1, 100) + await c.fetch(1, 100)
    assert {d.stream for d in ds} == {KEYS.requests, KEYS.bulk}
    assert await c.lease_held() == []
