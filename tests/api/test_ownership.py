"""Ownership: a request, file or batch is seen and changed only by the key that made it (and
admin keys); to another user key it does not exist (404), and lists show only the caller's own."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from redis.asyncio import Redis

from sluice.api.auth import digest
from sluice.broker.keys import ModelKeys
from sluice.broker.registry import ModelRegistry
from sluice.config.model import ModelConfig
from sluice.config.settings import Settings
from sluice.workers.jobs.runner import JobRunner
from tests.api.keyed_app import ADMIN, ALICE, BOB, client, keyed_app
from tests.broker.helpers import KEYS, MODEL
from tests.workers.test_job_runner import MODEL as JOB_MODEL
from tests.workers.test_job_runner import null_worker


class _NoJobs:
    """Stands for the Celery client: jobs are run by hand here."""

    def send_task(self, *_args: Any, **_kw: Any) -> None:
        return None


@pytest.fixture
async def app(redis: Redis, settings: Settings, tmp_path: Path) -> AsyncIterator[FastAPI]:
    # No worker runs here: routes that wait for a result give up at once.
    async with keyed_app(settings, tmp_path, max_wait_s=0.2) as app:
        app.state.sluice.celery = _NoJobs()
        yield app


@pytest.fixture
async def users(app: FastAPI) -> AsyncIterator[dict[str, httpx.AsyncClient]]:
    async with client(app, ADMIN) as admin, client(app, ALICE) as alice, client(app, BOB) as bob:
        yield {"admin": admin, "alice": alice, "bob": bob}


async def upload(c: httpx.AsyncClient, data: bytes = b'{"custom_id": "a"}\n') -> str:
    r = await c.post("/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"})
    assert r.status_code == 200, r.text
    assert "owner" not in r.json()
    return r.json()["id"]


async def new_batch(c: httpx.AsyncClient, file_id: str) -> str:
    r = await c.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions"})
    assert r.status_code == 200, r.text
    return r.json()["id"]


async def assert_missing(c: httpx.AsyncClient, calls: list[tuple[str, str, Any]], message: str) -> None:
    for method, url, body in calls:
        r = await c.request(method, url, json=body)
        assert r.status_code == 404, (method, url, r.text)
        assert r.json()["error"]["message"] == message, url


async def test_a_request_is_seen_and_cancelled_only_by_its_key_and_admins(
        users: dict[str, httpx.AsyncClient], redis: Redis) -> None:
    alice, bob, admin = users["alice"], users["bob"], users["admin"]
    rid = (await alice.post("/v1/requests", json={"prompt": "mine", "max_tokens": 2})).json()["id"]
    assert await redis.hget(KEYS.status(rid), "owner") == digest(ALICE)

    # Exactly what an unknown id gets: another key cannot tell that the request exists.
    await assert_missing(bob, [("GET", f"/v1/requests/{rid}", None), ("GET", f"/v1/requests/{rid}/events", None),
                               ("DELETE", f"/v1/requests/{rid}", None)], f"request {rid!r} not found")
    assert await redis.hget(KEYS.status(rid), "state") == "queued"
    assert (await alice.get(f"/v1/requests/{rid}")).json()["status"] == "queued"
    assert (await admin.get(f"/v1/requests/{rid}")).json()["status"] == "queued"
    assert (await alice.delete(f"/v1/requests/{rid}")).status_code == 200  # queued: cancelled at once


async def test_idempotency_keys_belong_to_their_api_key(users: dict[str, httpx.AsyncClient]) -> None:
    body, headers = {"prompt": "once", "max_tokens": 2}, {"Idempotency-Key": "order-1"}
    first = (await users["alice"].post("/v1/requests", json=body, headers=headers)).json()["id"]
    assert (await users["alice"].post("/v1/requests", json=body, headers=headers)).json()["id"] == first
    assert (await users["bob"].post("/v1/requests", json=body, headers=headers)).json()["id"] != first


async def test_every_route_that_submits_records_the_callers_key(
        users: dict[str, httpx.AsyncClient], redis: Redis) -> None:
    alice = users["alice"]
    await alice.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2})
    await alice.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2,
                                                   "messages": [{"role": "user", "content": "hi"}]})
    r = await alice.post(f"/v1/models/{MODEL}/infer", json=[{"prompt": "x", "max_tokens": 2}])
    assert r.status_code == 504, r.text  # no worker: the request stays queued
    owners = [await redis.hget(k, "owner") async for k in redis.scan_iter(match=KEYS.status("*"))]
    assert len(owners) == 4 and set(owners) == {digest(ALICE)}


async def test_files_are_seen_only_by_their_key_and_admins(users: dict[str, httpx.AsyncClient]) -> None:
    alice, bob, admin = users["alice"], users["bob"], users["admin"]
    data = b'{"custom_id": "a"}\n'
    mine, theirs = await upload(alice, data), await upload(bob)

    await assert_missing(bob, [("GET", f"/v1/files/{mine}", None), ("GET", f"/v1/files/{mine}/content", None),
                               ("DELETE", f"/v1/files/{mine}", None),
                               ("POST", "/v1/batches", {"input_file_id": mine, "endpoint": "/v1/completions"})],
                         f"file {mine!r} not found")
    for c, seen in ((alice, [mine]), (bob, [theirs]), (admin, [mine, theirs])):
        listed = (await c.get("/v1/files")).json()["data"]
        assert sorted(f["id"] for f in listed) == sorted(seen)
        assert all("owner" not in f for f in listed)
    got = (await alice.get(f"/v1/files/{mine}")).json()
    assert got["id"] == mine and "owner" not in got
    assert (await alice.get(f"/v1/files/{mine}/content")).content == data
    assert (await admin.get(f"/v1/files/{mine}/content")).content == data
    assert (await alice.delete(f"/v1/files/{mine}")).json()["deleted"] is True


async def test_batches_are_seen_only_by_their_key_and_admins(users: dict[str, httpx.AsyncClient]) -> None:
    alice, bob, admin = users["alice"], users["bob"], users["admin"]
    mine, theirs = await new_batch(alice, await upload(alice)), await new_batch(bob, await upload(bob))

    await assert_missing(bob, [("GET", f"/v1/batches/{mine}", None), ("POST", f"/v1/batches/{mine}/cancel", None)],
                         f"batch {mine!r} not found")
    for c, seen in ((alice, [mine]), (bob, [theirs]), (admin, [theirs, mine])):
        assert sorted(b["id"] for b in (await c.get("/v1/batches")).json()["data"]) == sorted(seen)
    assert (await alice.get(f"/v1/batches/{mine}")).json()["status"] == "validating"
    assert (await alice.post(f"/v1/batches/{mine}/cancel")).json()["status"] == "cancelled"
    assert (await admin.post(f"/v1/batches/{theirs}/cancel")).json()["status"] == "cancelled"


async def test_a_batch_job_gives_its_rows_and_output_file_to_the_batch_owner(
        users: dict[str, httpx.AsyncClient], redis: Redis, settings: Settings) -> None:
    alice, bob = users["alice"], users["bob"]
    await ModelRegistry(redis).deploy(ModelConfig(name=JOB_MODEL))
    lines = [json.dumps({"custom_id": f"row-{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": JOB_MODEL, "prompt": f"line {i}", "max_tokens": 2}}) for i in range(3)]
    batch_id = await new_batch(alice, await upload(alice, "\n".join(lines).encode()))

    async with null_worker(redis) as seen:
        await JobRunner(settings, redis, batch_id, poll_s=0.01).run()
    assert len(seen) == 3
    assert {await redis.hget(ModelKeys(JOB_MODEL).status(rid), "owner") for rid in seen} == {digest(ALICE)}
    batch = (await alice.get(f"/v1/batches/{batch_id}")).json()
    assert batch["status"] == "completed", batch
    output = batch["output_file_id"]
    assert (await alice.get(f"/v1/files/{output}/content")).status_code == 200
    assert (await bob.get(f"/v1/files/{output}/content")).status_code == 404
