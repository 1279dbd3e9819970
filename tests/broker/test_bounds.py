"""Everything a batch, a file or the inference log leaves in Redis (and on disk) is bounded."""

from __future__ import annotations

import asyncio
import io
import json
import os
import time

import pytest
from redis.asyncio import Redis

from sluice.broker.jobs.files import FileError, FileStore
from sluice.broker.jobs.store import JobStore
from sluice.broker.plumbing.connection import connect
from sluice.config.settings import Settings
from tests.broker.helpers import KEYS, assert_request_keys_expire, ready_consumer
from tests.conftest import TOPOLOGY


async def test_a_finished_batch_and_its_records_expire(redis: Redis) -> None:
    store = JobStore(redis, ttl_s=1000, result_ttl_s=100)
    batch = await store.create("file-x", "/v1/completions", "24h", None)
    assert await store.lock(batch["id"], "runner", 10)
    await store.move(batch["id"], "in_progress", ["validating"], "runner")
    await store.bind(batch["id"], "runner", 0, "req-a")
    await store.record(batch["id"], "runner", 0, {"id": "r"}, {"completed": 1})
    await assert_request_keys_expire(redis)  # bounded while it runs, too
    await store.move(batch["id"], "completed", ["in_progress"], "runner", output_file_id="file-out")
    await store.unlock(batch["id"], "runner")
    assert 900 < await redis.ttl(f"sluice:batch:{batch['id']}") <= 1000
    assert 0 < await redis.ttl(f"{{sluice:batch:{batch['id']}}}:out") <= 100
    assert 0 < await redis.ttl(f"{{sluice:batch:{batch['id']}}}:rids") <= 100
    await assert_request_keys_expire(redis)


async def test_a_batch_cancelled_before_it_ran_expires(redis: Redis) -> None:
    store = JobStore(redis, ttl_s=1000)
    batch = await store.create("file-x", "/v1/completions", "24h", None)
    assert (await store.request_cancel(batch["id"]))["status"] == "cancelled"  # type: ignore[index]
    assert 0 < await redis.ttl(f"sluice:batch:{batch['id']}") <= 1000


async def test_the_batch_index_forgets_batches_older_than_their_lifetime(redis: Redis) -> None:
    store = JobStore(redis, ttl_s=10)
    await redis.zadd("sluice:batches", {"batch_ancient": time.time() - 2 * 86400})
    await store.create("file-x", "/v1/completions", "24h", None)
    assert "batch_ancient" not in await redis.zrange("sluice:batches", 0, -1)
    assert 0 < await redis.ttl("sluice:batches")


async def test_files_expire_and_their_content_is_swept(redis: Redis, settings: Settings) -> None:
    files = FileStore(redis, settings.files_path, 10_000, ttl_s=5000)
    kept = await files.create("a.jsonl", "batch", b'{"x": 1}\n')
    assert kept["expires_at"] == kept["created_at"] + 5000
    assert 4000 < await redis.ttl(f"sluice:file:{kept['id']}") <= 5000
    short = await files.create("b.jsonl", "batch", b'{"x": 2}\n', expires_after_s=3600)
    assert 0 < await redis.ttl(f"sluice:file:{short['id']}") <= 3600
    await assert_request_keys_expire(redis)
    await redis.delete(f"sluice:file:{short['id']}")  # its TTL ran out
    old = time.time() - 3600
    for f in (kept, short):
        os.utime(files.path(f["id"]), (old, old))
    assert await files.sweep() == [short["id"]]
    assert files.path(kept["id"]).is_file() and not files.path(short["id"]).exists()


async def test_an_upload_is_copied_in_chunks_and_refused_past_the_limit(redis: Redis, settings: Settings) -> None:
    files = FileStore(redis, settings.files_path, 3 * 1024 * 1024)
    meta = await files.create_from("big.jsonl", "batch", io.BytesIO(b"{}\n" * 1_000_000))
    assert meta["bytes"] == 3_000_000
    with pytest.raises(FileError) as refused:
        await files.create_from("huge.jsonl", "batch", io.BytesIO(b"{}\n" * 2_000_000))
    assert refused.value.status == 413
    assert sorted(os.listdir(settings.files_path)) == [meta["id"]]  # no half-written part left
    with pytest.raises(FileError):
        await files.create_from("blank.jsonl", "batch", io.BytesIO(b"  \n\n"))


async def test_log_records_have_a_byte_budget(redis: Redis, settings: Settings) -> None:
    c = await ready_consumer(redis, settings)
    big = "word " * 40_000
    await c.append_log([{"request_id": "req-a", "row": 0, "status": "done", "input": {"prompt": big},
                         "output": {"generated_text": big}}, {"request_id": "req-b", "row": 0, "input": {}}])
    (_, first), (_, second) = await redis.xrange(KEYS.log)
    record = json.loads(first["data"])
    assert len(first["data"]) <= settings.log_max_record_bytes
    assert record["truncated"] and record["input"]["prompt"].startswith("word word")
    assert json.loads(second["data"]) == {"request_id": "req-b", "row": 0, "input": {}}


async def test_more_commands_at_once_than_connections_wait_for_one(redis: Redis, redis_url: str) -> None:
    """A worker runs up to 256 requests at once: their Redis commands beyond the pool's bound
    wait for a free connection. redis-py's plain pool failed them with "Too many connections"
    (at 100), and each such request waited out a whole lease before it was run again."""
    client = connect(redis_url, name="sluice-test-bounded", max_connections=16)
    try:
        # 150 commands that each hold a connection for 0.3 s: more than redis-py's own default
        # bound of 100, and ten times this pool's.
        got = await asyncio.gather(*(client.blpop([f"bounds:empty:{i}"], timeout=0.3) for i in range(150)))
        assert got == [None] * 150
        held = [c for c in await redis.client_list() if c.get("name") == "sluice-test-bounded"]
        assert 0 < len(held) <= 16
    finally:
        await client.aclose()


@pytest.mark.skipif(TOPOLOGY != "cluster", reason="the cluster client's own bound")
async def test_the_cluster_bound_lets_a_pipeline_resend_a_redirected_command(redis_url: str) -> None:
    """redis-py's cluster pipeline resends a command that was redirected (MOVED, ASK: a
    failover) through execute_command while it holds its place in the bound: with every place
    held that way, a bound that is not re-entrant waits for itself for ever."""
    client = connect(redis_url, name="sluice-test-bounded", max_connections=1)
    try:
        async with client._place():  # as a pipeline executing holds it
            assert await asyncio.wait_for(client.set("bounds:nested", "1"), 5)
        got = await asyncio.gather(*(client.get("bounds:nested") for _ in range(20)))  # still bounded, still works
        assert got == ["1"] * 20
    finally:
        await client.aclose()
