"""A job's input file is read a chunk at a time, off the event loop: the runner keeps its lock
while it checks a big file, a file over the line cap fails naming the limit without a row
submitted, and a line over the byte cap is an error line, never read whole."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from redis.asyncio import Redis

from sluice.broker.jobs.files import FileStore
from sluice.broker.jobs.store import JobStore
from sluice.broker.registry import ModelRegistry
from sluice.config.model import ModelConfig
from sluice.config.settings import Settings
from sluice.workers.jobs import lines as job_lines
from tests.broker.helpers import queued_len
from tests.workers.test_job_runner import MODEL, STREAM, null_worker, runner


def request(i: int, prompt: str | None = None) -> str:
    return json.dumps({"custom_id": f"row-{i}", "method": "POST", "url": "/v1/completions",
                       "body": {"model": MODEL, "prompt": prompt or f"line {i}", "max_tokens": 2}})


async def batch_of(redis: Redis, settings: Settings, lines: list[str]) -> str:
    await ModelRegistry(redis).deploy(ModelConfig(name=MODEL))
    f = await FileStore(redis, settings.files_path, settings.max_file_bytes).create(
        "in.jsonl", "batch", "\n".join(lines).encode())
    return (await JobStore(redis).create(f["id"], "/v1/completions", "24h", None))["id"]


def file_records(settings: Settings, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    path = settings.files_path / file_id  # FileStore.path
    return [json.loads(x) for x in path.read_text().splitlines()]


async def test_the_runner_keeps_its_lock_while_it_checks_a_big_file(
        redis: Redis, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checking the file takes twice the lock's TTL (each line of the first reading costs 2 ms
    here): on the event loop, the lock lapsed and the batch stayed `validating`; in a thread,
    the lock is kept (refreshed every third of its TTL: a stall of over 1.3 s would lose it)."""
    n = 2000
    parse, slow_calls = job_lines.parse_line, n

    def slow(*args: Any, **kwargs: Any) -> Any:
        nonlocal slow_calls
        if slow_calls > 0:
            slow_calls -= 1
            time.sleep(0.002)
        return parse(*args, **kwargs)

    monkeypatch.setattr(job_lines, "parse_line", slow)
    job_settings = settings.model_copy(update={"job_lock_ttl_s": 2.0, "bulk_outstanding": 64})
    # Most lines name a model that is not deployed: checked like the others, never queued.
    lines = [request(i) if i < 20 else request(i).replace(f'"{MODEL}"', '"absent"') for i in range(n)]
    batch_id = await batch_of(redis, job_settings, lines)
    async with null_worker(redis, delay_s=0):
        await asyncio.wait_for(runner(redis, job_settings, batch_id).run(), timeout=120)
    batch = await JobStore(redis).get(batch_id)
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": n, "completed": 20, "failed": n - 20}


async def test_a_file_over_the_line_cap_fails_naming_the_limit_and_submits_nothing(
        redis: Redis, settings: Settings) -> None:
    job_settings = settings.model_copy(update={"max_batch_lines": 5})
    batch_id = await batch_of(redis, job_settings, [request(i) for i in range(6)])
    await asyncio.wait_for(runner(redis, job_settings, batch_id).run(), timeout=30)
    batch = await JobStore(redis).get(batch_id)
    assert batch["status"] == "failed", batch
    (error,) = batch["errors"]["data"]
    assert "more than 5 requests" in error["message"] and "SLUICE_MAX_BATCH_LINES" in error["message"]
    assert await queued_len(redis, STREAM) == 0
    # At the cap, it runs.
    batch_id = await batch_of(redis, job_settings, [request(i) for i in range(5)] + ["", "  "])
    async with null_worker(redis, delay_s=0):
        await asyncio.wait_for(runner(redis, job_settings, batch_id).run(), timeout=30)
    assert (await JobStore(redis).get(batch_id))["request_counts"] == {"total": 5, "completed": 5, "failed": 0}


async def test_a_line_over_the_byte_cap_is_an_error_line_and_the_others_run(redis: Redis, settings: Settings) -> None:
    job_settings = settings.model_copy(update={"max_batch_line_bytes": 300})
    lines = [request(0), request(1, "x" * 1000), request(2), request(3, "y" * 290)]
    batch_id = await batch_of(redis, job_settings, lines)
    async with null_worker(redis, delay_s=0) as seen:
        await asyncio.wait_for(runner(redis, job_settings, batch_id).run(), timeout=30)
    batch = await JobStore(redis).get(batch_id)
    assert batch["request_counts"] == {"total": 4, "completed": 2, "failed": 2}, batch
    assert len(seen) == 2
    errors = file_records(job_settings, batch["error_file_id"])
    assert [e["error"]["code"] for e in errors] == ["line_too_long", "line_too_long"]
    assert "line 2: longer than 300 bytes (SLUICE_MAX_BATCH_LINE_BYTES)" == errors[0]["error"]["message"]
    ok = file_records(job_settings, batch["output_file_id"])
    assert sorted(r["custom_id"] for r in ok) == ["row-0", "row-2"]


async def test_a_line_its_route_would_refuse_gets_its_error_in_the_error_file(redis: Redis, settings: Settings) -> None:
    job_settings = settings.model_copy(update={"max_prompt_chars": 50})
    lines = [request(0), request(1, "x" * 51), request(2, "y" * 50),
             json.dumps({"custom_id": "row-3", "method": "POST", "url": "/v1/completions",
                         "body": {"model": MODEL, "prompt": "z", "max_tokens": 2_000_000}})]
    batch_id = await batch_of(redis, job_settings, lines)
    async with null_worker(redis, delay_s=0) as seen:
        await asyncio.wait_for(runner(redis, job_settings, batch_id).run(), timeout=30)
    batch = await JobStore(redis).get(batch_id)
    assert batch["request_counts"] == {"total": 4, "completed": 2, "failed": 2}, batch
    assert len(seen) == 2  # the refused lines never reached the queue
    errors = {e["custom_id"]: e["error"] for e in file_records(job_settings, batch["error_file_id"])}
    assert errors["row-1"] == {"code": "prompt_too_long", "message": "line 2: prompt: longer than 50 characters"}
    assert errors["row-3"]["code"] == "max_tokens" and "at most 1000000" in errors["row-3"]["message"]


async def test_the_result_files_are_written_a_chunk_of_records_at_a_time(
        redis: Redis, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """Finishing a big batch never holds all its records: they are read a chunk at a time and
    written in input order."""
    n = 300  # more than one chunk (256)
    lines = [request(i) if i % 7 else request(i, "x" * 100) for i in range(n)]
    job_settings = settings.model_copy(update={"max_prompt_chars": 50, "bulk_outstanding": 64})
    batch_id = await batch_of(redis, job_settings, lines)
    monkeypatch.setattr(JobStore, "outputs", lambda *_: pytest.fail("every record read at once"))
    read = JobStore.records
    sizes: list[int] = []

    async def records(self: JobStore, job_id: str, wanted: list[int]) -> list[dict[str, Any]]:
        sizes.append(len(wanted))
        return await read(self, job_id, wanted)

    monkeypatch.setattr(JobStore, "records", records)
    async with null_worker(redis, delay_s=0):
        await asyncio.wait_for(runner(redis, job_settings, batch_id).run(), timeout=60)
    batch = await JobStore(redis).get(batch_id)
    failed = len(range(0, n, 7))
    assert batch["request_counts"] == {"total": n, "completed": n - failed, "failed": failed}, batch
    assert [r["custom_id"] for r in file_records(job_settings, batch["output_file_id"])] == [
        f"row-{i}" for i in range(n) if i % 7]
    assert [r["custom_id"] for r in file_records(job_settings, batch["error_file_id"])] == [
        f"row-{i}" for i in range(0, n, 7)]
    assert sum(sizes) == n and max(sizes) <= 256
