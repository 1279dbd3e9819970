"""JobStore on a private Redis: the OpenAI batch object, listing by owner, status moves that are
conditional and fenced by the job's lock, write-once rows and records, and TTLs on every key."""

from __future__ import annotations

import os

import pytest
from redis.asyncio import Redis

from sluice.broker.jobs.store import JobStore, LockLost, _key

TOKEN, OTHER = "runner-1", "runner-2"


@pytest.fixture
def store(redis: Redis) -> JobStore:
    return JobStore(redis, ttl_s=3600, result_ttl_s=600)


async def test_a_new_batch_is_an_openai_batch_object_without_its_owner(store: JobStore) -> None:
    batch = await store.create("file-1", "/v1/completions", "24h", {"k": "v"}, owner="alice")
    assert batch["object"] == "batch" and batch["status"] == "validating"
    assert batch["input_file_id"] == "file-1" and batch["metadata"] == {"k": "v"}
    assert batch["expires_at"] == batch["created_at"] + 24 * 3600
    assert batch["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    assert batch["errors"] is None and batch["completed_at"] is None
    assert "owner" not in batch
    assert await store.owner(batch["id"]) == "alice"
    assert await store.get("batch_absent") is None and await store.owner("batch_absent") is None


async def test_every_key_has_a_ttl(store: JobStore, redis: Redis) -> None:
    batch = await store.create("f", "/v1/completions", "24h", None)
    assert await store.lock(batch["id"], TOKEN, 30)
    await store.bind(batch["id"], TOKEN, 0, "req-1")
    await store.record(batch["id"], TOKEN, 0, {"custom_id": "a"}, {"completed": 1})
    keys = [k async for k in redis.scan_iter("*")]
    assert keys
    assert [k for k in keys if await redis.ttl(k) <= 0] == []


async def test_list_is_newest_first_by_owner_with_after(store: JobStore, redis: Redis) -> None:
    ids = [(await store.create("f", "/v1/completions", "24h", None, owner=o))["id"]
           for o in ("alice", "bob", "alice")]
    for i, batch_id in enumerate(ids):  # one created_at per second apart, so the order is known
        await redis.zadd("sluice:batches", {batch_id: 1000 + i})
    assert [b["id"] for b in await store.list()] == ids[::-1]
    assert [b["id"] for b in await store.list(owner="alice")] == [ids[2], ids[0]]
    assert [b["id"] for b in await store.list(limit=1)] == [ids[2]]
    assert [b["id"] for b in await store.list(after=ids[2])] == [ids[1], ids[0]]
    assert [b["id"] for b in await store.list(after="batch_unknown")] == ids[::-1]  # an unknown cursor: from the top


async def test_moves_are_conditional_on_the_current_status(store: JobStore) -> None:
    batch_id = (await store.create("f", "/v1/completions", "24h", None))["id"]
    assert await store.move(batch_id, "in_progress", ["validating"]) == "in_progress"
    assert await store.move(batch_id, "completed", ["validating"]) == "in_progress"  # not expected: unchanged
    assert await store.move("batch_absent", "in_progress", ["validating"]) == ""
    moved = await store.get(batch_id)
    assert moved and moved["in_progress_at"] is not None


async def test_a_runner_without_the_lock_writes_nothing(store: JobStore) -> None:
    batch_id = (await store.create("f", "/v1/completions", "24h", None))["id"]
    assert await store.lock(batch_id, TOKEN, 30)
    assert not await store.lock(batch_id, OTHER, 30)  # one runner at a time
    with pytest.raises(LockLost):
        await store.move(batch_id, "in_progress", ["validating"], token=OTHER)
    with pytest.raises(LockLost):
        await store.bind(batch_id, OTHER, 0, "req-x")
    with pytest.raises(LockLost):
        await store.record(batch_id, OTHER, 0, {"x": 1}, {"completed": 1})
    assert await store.request_ids(batch_id) == {} and await store.outputs(batch_id) == {}
    assert not await store.refresh_lock(batch_id, OTHER, 30)
    await store.unlock(batch_id, OTHER)  # another's token releases nothing
    assert await store.holds_lock(batch_id, TOKEN)
    assert await store.refresh_lock(batch_id, TOKEN, 30)
    await store.unlock(batch_id, TOKEN)
    assert not await store.holds_lock(batch_id, TOKEN)


async def test_rows_and_records_are_written_once_and_counted_with_their_record(store: JobStore) -> None:
    batch_id = (await store.create("f", "/v1/completions", "24h", None))["id"]
    assert await store.lock(batch_id, TOKEN, 30)
    await store.bind(batch_id, TOKEN, 3, "req-first")
    await store.bind(batch_id, TOKEN, 3, "req-second")
    assert await store.request_ids(batch_id) == {3: "req-first"}
    assert await store.record(batch_id, TOKEN, 3, {"custom_id": "c"}, {"completed": 1, "output_tokens": 5})
    assert not await store.record(batch_id, TOKEN, 3, {"custom_id": "again"}, {"completed": 1})
    assert await store.outputs(batch_id) == {3: {"custom_id": "c"}}
    batch = await store.get(batch_id)
    assert batch and batch["request_counts"]["completed"] == 1 and batch["usage"]["output_tokens"] == 5


async def test_cancel_of_an_unstarted_batch_is_at_once_and_of_a_running_one_is_cancelling(
        store: JobStore) -> None:
    waiting = (await store.create("f", "/v1/completions", "24h", None))["id"]
    assert (await store.request_cancel(waiting) or {})["status"] == "cancelled"
    running = (await store.create("f", "/v1/completions", "24h", None))["id"]
    assert await store.lock(running, TOKEN, 30)
    await store.move(running, "in_progress", ["validating"], token=TOKEN)
    assert (await store.request_cancel(running) or {})["status"] == "cancelling"
    assert await store.request_cancel("batch_absent") is None
    assert await store.unfinished() == [running]


async def test_a_failed_batch_carries_its_error(store: JobStore, redis: Redis) -> None:
    batch_id = (await store.create("f", "/v1/completions", "24h", None))["id"]
    await store.move(batch_id, "failed", ["validating"], error="line 1: not JSON")
    batch = await store.get(batch_id)
    assert batch and batch["status"] == "failed"
    assert batch["errors"]["data"][0]["message"] == "line 1: not JSON"
    assert 0 < await redis.ttl(_key(batch_id)) <= 3600  # final: the retention starts


@pytest.mark.skipif(os.environ.get("SLUICE_TEST_REDIS") == "cluster",
                    reason="counts the reads in one server's INFO commandstats")
async def test_a_keys_listing_reads_only_its_own_batches(store: JobStore, redis: Redis) -> None:
    mine = [(await store.create("f", "/v1/completions", "24h", None, owner="alice"))["id"] for _ in range(3)]
    for _ in range(300):
        await store.create("f", "/v1/completions", "24h", None, owner="bob")
    stats = await redis.info("commandstats")
    before = int(stats.get("cmdstat_hgetall", {}).get("calls", 0))
    assert [b["id"] for b in await store.list(owner="alice")] == mine[::-1]
    assert [b["id"] for b in await store.list(owner="alice", limit=2, after=mine[2])] == [mine[1], mine[0]]
    stats = await redis.info("commandstats")
    assert int(stats["cmdstat_hgetall"]["calls"]) - before == 5  # not one read of bob's 300
