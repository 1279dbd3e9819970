"""Bulk jobs: one runner per job at a time, restarts that re-dispatch only jobs whose runner is
gone, and cancel against completion. Real Redis; a tiny in-process null worker finishes rows."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from celery.signals import worker_ready
from redis.asyncio import Redis

from sluice.broker.delivery.consumer import StreamConsumer
from sluice.broker.jobs.files import FileStore
from sluice.broker.jobs.store import JobStore
from sluice.broker.keys import ModelKeys
from sluice.broker.limits import ConsumerLimits
from sluice.broker.registry import ModelRegistry
from sluice.config.model import ModelConfig
from sluice.config.settings import Settings
from sluice.workers.jobs.app import celery_app
from sluice.workers.jobs.runner import JobRunner
from tests.broker.helpers import done_result, queued_len

MODEL = "bj"
STREAM = ModelKeys(MODEL).bulk


@pytest.fixture
def job_settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"job_lock_ttl_s": 0.6, "bulk_outstanding": 4})


@pytest.fixture
def steady_settings(settings: Settings) -> Settings:
    """A lock no stall of a loaded machine lapses (30 s; refreshed every second all the same):
    for the tests whose live runner must stay live. With 0.6 s, a test process or Redis held
    off the CPU for 0.4 s lost its runner's lock to nobody, and the job went to whoever came
    next, or to no one."""
    return settings.model_copy(update={"job_lock_ttl_s": 30.0, "bulk_outstanding": 4})


def lock_key(batch_id: str) -> str:
    return f"{{sluice:batch:{batch_id}}}:lock"


async def new_batch(redis: Redis, settings: Settings, n: int) -> str:
    await ModelRegistry(redis).deploy(ModelConfig(name=MODEL))
    lines = [json.dumps({"custom_id": f"row-{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": MODEL, "prompt": f"line {i}", "max_tokens": 2}}) for i in range(n)]
    f = await FileStore(redis, settings.files_path, settings.max_file_bytes).create(
        "in.jsonl", "batch", "\n".join(lines).encode())
    return (await JobStore(redis).create(f["id"], "/v1/completions", "24h", None))["id"]


@asynccontextmanager
async def null_worker(redis: Redis, delay_s: float = 0.005,
                      running: asyncio.Event | None = None) -> AsyncIterator[list[str]]:
    """Finishes every row put on the bulk lane (while `running`, when given, is set) through a
    real consumer (fetch: the fair-share dispatch of staged rows, then the read; start; commit);
    yields the request ids of the entries it took, in order (a row submitted twice shows twice)."""
    seen: list[str] = []
    stop = asyncio.Event()
    consumer = StreamConsumer(redis, MODEL, "job-test-worker",
                              ConsumerLimits(status_ttl_s=3600, reply_ttl_s=600, log_max_len=100))
    await consumer.ensure_groups()

    async def work() -> None:
        # Ends on a flag, not on cancellation alone: redis-py on Python 3.11 can swallow a
        # cancel that lands as a call completes (see Worker.run), and the loop would go on.
        while not stop.is_set():
            if running is not None and not running.is_set():
                await asyncio.sleep(0.005)
                continue
            for d in await consumer.fetch(1, 10):
                seen.append(d.message.id)
                await asyncio.sleep(delay_s)
                if await consumer.start(d) == "run":  # not when cancelled or final meanwhile
                    await consumer.commit(d, done_result())
                consumer.release(d)
            await asyncio.sleep(0.001)

    task = asyncio.create_task(work())
    try:
        yield seen
    finally:
        stop.set()
        task.cancel()
        await asyncio.wait([task], timeout=5)


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def recorded(redis: Redis, batch_id: str) -> int:
    return await redis.hlen(f"{{sluice:batch:{batch_id}}}:out")


def runner(redis: Redis, settings: Settings, batch_id: str) -> JobRunner:
    return JobRunner(settings, redis, batch_id, poll_s=0.01)


async def running_job(redis: Redis, settings: Settings, batch_id: str, until_recorded: int) -> asyncio.Task[None]:
    """A runner started on the batch, once it has recorded that many rows."""
    task = asyncio.create_task(runner(redis, settings, batch_id).run())
    await until(lambda: _at_least(recorded(redis, batch_id), until_recorded), timeout_s=60)  # a hang guard
    return task


def files_in(settings: Settings) -> list[Path]:
    return sorted(settings.files_path.iterdir())


async def test_a_runner_whose_lock_is_stolen_stops_and_writes_nothing(redis: Redis, steady_settings: Settings) -> None:
    job_settings = steady_settings  # stolen, never lapsed: the only other runner is the test's
    batch_id = await new_batch(redis, job_settings, 60)
    async with null_worker(redis) as seen:
        running = await running_job(redis, job_settings, batch_id, 5)
        await redis.set(lock_key(batch_id), "another-runner", px=60_000)
        at_steal = await recorded(redis, batch_id)
        await asyncio.wait_for(running, timeout=3 * job_settings.job_lock_ttl_s)  # it stopped
        # What it had submitted finishes meanwhile (a condition, not a pause a slow machine could outlast).
        await until(lambda: _drained(redis), timeout_s=60)  # a hang guard
        assert await recorded(redis, batch_id) == at_steal  # no record after the steal
        assert (await JobStore(redis).get(batch_id))["status"] == "in_progress"
        assert len(files_in(job_settings)) == 1  # the input file only
        await redis.delete(lock_key(batch_id))  # the other runner went away in turn
        await runner(redis, job_settings, batch_id).run()
    await assert_completed_once(redis, job_settings, batch_id, 60, seen)


async def test_two_runners_across_an_expired_lock_submit_each_row_once(redis: Redis, job_settings: Settings) -> None:
    batch_id = await new_batch(redis, job_settings, 60)
    async with null_worker(redis) as seen:
        running = await running_job(redis, job_settings, batch_id, 5)
        await redis.delete(lock_key(batch_id))  # as if the first runner had stalled past its TTL
        second = asyncio.create_task(runner(redis, job_settings, batch_id).run())
        await asyncio.wait_for(asyncio.gather(running, second), timeout=20)
    await assert_completed_once(redis, job_settings, batch_id, 60, seen)


async def test_a_second_run_leaves_the_job_to_its_live_runner(redis: Redis, steady_settings: Settings) -> None:
    job_settings = steady_settings  # its lock cannot lapse: the runner is live whatever the load
    batch_id = await new_batch(redis, job_settings, 20)
    working = asyncio.Event()
    working.set()
    async with null_worker(redis, delay_s=0.02, running=working) as seen:
        running = await running_job(redis, job_settings, batch_id, 2)
        working.clear()  # the job cannot end while the second run looks: no race with its 18 rows
        # A re-dispatched task does not wait for the whole job in a Celery slot: it returns
        # while the job cannot end (waiting for it would hang here until the guard).
        await asyncio.wait_for(runner(redis, job_settings, batch_id).run(), timeout=60)
        assert not running.done()
        assert await redis.get(lock_key(batch_id)) is not None  # held still: the second took nothing
        working.set()
        await asyncio.wait_for(running, timeout=300)  # a hang guard: 18 rows take a second
    await assert_completed_once(redis, job_settings, batch_id, 20, seen)


async def assert_completed_once(redis: Redis, settings: Settings, batch_id: str, n: int, seen: list[str]) -> None:
    batch = await JobStore(redis).get(batch_id)
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": n, "completed": n, "failed": 0}
    assert len(seen) == n and len(set(seen)) == n  # every row submitted once
    rids = await redis.hgetall(f"{{sluice:batch:{batch_id}}}:rids")
    assert set(rids.values()) == set(seen)
    out = FileStore(redis, settings.files_path, settings.max_file_bytes).path(batch["output_file_id"])
    assert sorted(json.loads(x)["custom_id"] for x in out.read_text().splitlines()) == sorted(
        f"row-{i}" for i in range(n))
    assert len(files_in(settings)) == 2  # the input and one output: the loser wrote none


async def _at_least(count: Awaitable[int], n: int) -> bool:
    return await count >= n


async def _drained(redis: Redis) -> bool:
    """Every row on the bulk stream taken and finished by the null worker (it deletes each one)."""
    return await queued_len(redis, STREAM) == 0


async def test_a_restart_redispatches_only_jobs_whose_runner_is_gone(redis: Redis, settings: Settings) -> None:
    store = JobStore(redis)
    ids = {name: (await store.create("file-x", "/v1/completions", "24h", None))["id"]
           for name in ("orphan", "lapsing", "alive", "done")}
    for name in ("orphan", "lapsing", "alive"):
        await redis.hset(f"sluice:batch:{ids[name]}", "status", "in_progress")
    await redis.hset(f"sluice:batch:{ids['done']}", "status", "completed")
    await redis.set(lock_key(ids["lapsing"]), "killed-runner", px=400)  # its runner died just now

    async def live_runner() -> None:
        while True:
            await redis.set(lock_key(ids["alive"]), "live-runner", px=400)
            await asyncio.sleep(0.1)

    refresher = asyncio.create_task(live_runner())
    app = celery_app(settings)
    sent: list[str] = []
    app.send_task = lambda name, args, **_: sent.append(args[0])  # type: ignore[method-assign]
    receivers = list(worker_ready.receivers)
    try:
        await asyncio.sleep(0.05)
        await asyncio.to_thread(worker_ready.send, sender=None)
        for t in [t for t in threading.enumerate() if t.name == "sluice-jobs-resume"]:
            await asyncio.to_thread(t.join, 5)
        await asyncio.sleep(0.6)
    finally:
        refresher.cancel()
        worker_ready.receivers[:] = receivers
        worker_ready.sender_receivers_cache.clear()
    assert sorted(sent) == sorted([ids["orphan"], ids["lapsing"]])


@pytest.mark.parametrize("status", ["finalizing", "completed", "failed", "expired", "cancelled", "cancelling"])
async def test_cancel_answers_a_finalizing_or_final_batch_with_its_status(redis: Redis, status: str) -> None:
    store = JobStore(redis)
    batch_id = (await store.create("file-x", "/v1/completions", "24h", None))["id"]
    await redis.hset(f"sluice:batch:{batch_id}", "status", status)
    assert (await store.request_cancel(batch_id))["status"] == status
    assert (await store.get(batch_id))["status"] == status
    assert await store.request_cancel("batch_nope") is None


async def test_cancel_before_any_runner_started_is_final_at_once(redis: Redis, job_settings: Settings) -> None:
    batch_id = await new_batch(redis, job_settings, 5)
    cancelled = await JobStore(redis).request_cancel(batch_id)
    assert cancelled["status"] == "cancelled" and cancelled["cancelled_at"]
    async with null_worker(redis) as seen:
        await asyncio.wait_for(runner(redis, job_settings, batch_id).run(), timeout=5)
    assert seen == [] and (await JobStore(redis).get(batch_id))["status"] == "cancelled"


async def test_a_completion_racing_a_cancel_never_leaves_the_batch_cancelling(
        redis: Redis, job_settings: Settings) -> None:
    batch_id = await new_batch(redis, job_settings, 5)
    async with null_worker(redis):
        job = runner(redis, job_settings, batch_id)
        await redis.hset(f"sluice:batch:{batch_id}", "status", "in_progress")  # a runner had started it
        api = JobStore(redis)
        read = api.get
        calls = 0

        async def get_then_complete(bid: str) -> dict | None:
            """The runner completes the batch between the cancel's read and its write."""
            nonlocal calls
            found = await read(bid)
            calls += 1
            if calls == 1:
                await job.run()
            return found

        api.get = get_then_complete  # type: ignore[method-assign]
        answer = await api.request_cancel(batch_id)
    final = (await JobStore(redis).get(batch_id))["status"]
    assert final in ("completed", "cancelled"), final
    assert answer["status"] == final or (answer["status"] == "cancelling" and final == "cancelled")


async def test_a_cancel_during_the_run_ends_cancelled_with_partial_output(
        redis: Redis, job_settings: Settings) -> None:
    batch_id = await new_batch(redis, job_settings, 100)
    async with null_worker(redis, delay_s=0.01):
        running = await running_job(redis, job_settings, batch_id, 10)
        assert (await JobStore(redis).request_cancel(batch_id))["status"] == "cancelling"
        await asyncio.wait_for(running, timeout=10)
    batch = await JobStore(redis).get(batch_id)
    assert batch["status"] == "cancelled"
    assert 10 <= batch["request_counts"]["completed"] < 100
    out = FileStore(redis, job_settings.files_path, job_settings.max_file_bytes).path(batch["output_file_id"])
    assert len(out.read_text().splitlines()) == batch["request_counts"]["completed"]
