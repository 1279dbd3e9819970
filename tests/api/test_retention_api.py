"""Past its retention a request's result is gone, and the api says so (410), while an id that
never existed is still a 404; a multi-request admission through the api state is whole."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI
from redis.asyncio import Redis

from sluice.api.errors import ApiError
from sluice.api.intake import Sampling
from sluice.protocol.ids import new_request_id, request_created_at
from tests.api.conftest import StartApi
from tests.broker.helpers import KEYS, MODEL, queued_len

MODELS_YAML = (f"models:\n  - name: {MODEL}\n    max_queued: 4\n    result_ttl_s: 1\n"
               f"    dynamic_batching_config: {{batch_size_target: 4}}\n")


@pytest.fixture
async def app(start_api: StartApi) -> AsyncIterator[FastAPI]:
    async with start_api(MODELS_YAML, max_queued=4) as built:
        yield built


def test_request_ids_carry_their_creation_time() -> None:
    rid = new_request_id()
    assert abs(request_created_at(rid) - time.time()) < 5  # type: ignore[operator]
    assert request_created_at(f"req-{uuid.uuid4().hex}") is None


async def test_an_expired_result_is_gone_and_an_unknown_id_is_not_found(api: httpx.AsyncClient, redis: Redis) -> None:
    sent = await api.post("/v1/requests", json={"prompt": "hello", "max_tokens": 3})
    assert sent.status_code == 202
    rid = sent.json()["id"]
    assert (await api.get(f"/v1/requests/{rid}")).status_code == 200
    await redis.delete(KEYS.status(rid))  # what its TTL does once the retention has passed
    # The id is younger than the retention (1 s) for a moment, and a 404 while it is; then a 410.
    deadline = time.monotonic() + 30
    while (gone := await api.get(f"/v1/requests/{rid}")).status_code == 404:
        assert time.monotonic() < deadline, "the id never passed its retention"
        await asyncio.sleep(0.05)
    assert gone.status_code == 410 and "expired" in gone.text
    assert (await api.get(f"/v1/requests/{rid}/events")).status_code == 410
    young = new_request_id()
    assert (await api.get(f"/v1/requests/{young}")).status_code == 404
    for other in (f"req-{uuid.uuid4().hex}", "req-123-abc", "nonsense"):
        assert (await api.get(f"/v1/requests/{other}")).status_code == 404


async def test_a_multi_request_admission_is_whole(app, redis: Redis) -> None:
    s = app.state.sluice
    model = await s.deployments.get(MODEL)
    with pytest.raises(ApiError) as refused:
        await s.intake.enqueue_many(model, [[{"prompt": f"p{i}", "max_tokens": 2}] for i in range(5)])
    assert refused.value.status == 503
    assert await queued_len(redis, KEYS.requests) == 0
    messages = await s.intake.enqueue_many(model, [[{"prompt": f"p{i}", "max_tokens": 2}] for i in range(4)],
                                           Sampling(seed=10))
    assert [m.sampling.seed for m in messages] == [10, 11, 12, 13]
    assert await queued_len(redis, KEYS.requests) == 4


async def test_an_upload_names_when_it_expires(api: httpx.AsyncClient, redis: Redis) -> None:
    form = {"purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"}
    sent = await api.post("/v1/files", data=form, files={"file": ("in.jsonl", b'{"a": 1}\n')})
    assert sent.status_code == 200, sent.text
    meta = sent.json()
    assert meta["expires_at"] == meta["created_at"] + 3600
    assert 0 < await redis.ttl(f"sluice:file:{meta['id']}") <= 3600
    default = (await api.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", b"{}\n")})).json()
    assert default["expires_at"] == default["created_at"] + 30 * 86400
    too_short = {**form, "expires_after[seconds]": "60"}
    assert (await api.post("/v1/files", data=too_short, files={"file": ("x.jsonl", b"{}\n")})).status_code == 422
