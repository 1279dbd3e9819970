"""A client retrying a submit with its Idempotency-Key never makes two requests, whatever
failed in between (the api itself answered no, Redis went away after or before admitting)."""

from __future__ import annotations

import httpx
import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from sluice.broker.keys import idempotency
from sluice.config.settings import Settings
from tests.api.conftest import MODELS_YAML, StartApi, http_client
from tests.broker.helpers import KEYS, MODEL

BODY = {"prompt": "hello", "max_tokens": 3}


def fail_admission(app, *, after: bool) -> list[str]:
    """Make the next admission raise a Redis connection error, after (or before) it ran."""
    admission = app.state.sluice.admission
    real = admission.submit
    failed: list[str] = []

    async def submit(message, **kw):
        if not failed:
            failed.append(message.id)
            if after:
                await real(message, **kw)
            raise RedisConnectionError("Connection reset by peer")
        return await real(message, **kw)

    admission.submit = submit
    return failed


@pytest.mark.parametrize("after", [True, False], ids=["redis-failed-after-admitting", "redis-failed-before"])
async def test_a_retry_after_a_redis_failure_is_the_same_request(
        app, api: httpx.AsyncClient, redis: Redis, after: bool) -> None:
    failed = fail_admission(app, after=after)
    headers = {"Idempotency-Key": "order-42"}
    first = await api.post("/v1/requests", json=BODY, headers=headers)
    # Redis failed mid-call: a 503 to retry (with the same key), never a 500
    assert first.status_code == 503 and first.headers["Retry-After"] and failed
    assert first.json()["error"]["type"] == "unavailable"
    again = await api.post("/v1/requests", json=BODY, headers=headers)
    assert again.status_code == 202, again.text
    assert again.json()["id"] == failed[0]
    assert await redis.xlen(KEYS.requests) == 1


async def test_a_refused_submit_frees_its_key(
        api: httpx.AsyncClient, redis: Redis, settings: Settings) -> None:
    """Refused after the key was claimed (the prompt is too long): nothing was enqueued, so
    the key is free again and a corrected retry becomes a new request."""
    headers = {"Idempotency-Key": "order-43"}
    too_long = "x" * (settings.max_prompt_chars + 1)
    refused = await api.post("/v1/requests", json={"prompt": too_long, "max_tokens": 3}, headers=headers)
    assert refused.status_code == 413, refused.text
    assert not [k async for k in redis.scan_iter(idempotency("*"))]  # released
    ok = await api.post("/v1/requests", json=BODY, headers=headers)
    assert ok.status_code == 202
    assert await redis.xlen(KEYS.requests) == 1


async def test_a_multi_prompt_completion_is_admitted_whole_or_refused_whole(
        redis: Redis, start_api: StartApi) -> None:
    async with start_api(MODELS_YAML.replace("    continuous", "    max_queued: 3\n    continuous")) as app:
        async with http_client(app) as client:
            body = {"model": MODEL, "prompt": ["a", "b"], "n": 2, "max_tokens": 3}
            refused = await client.post("/v1/completions", json=body)
            assert refused.status_code == 503, refused.text
            assert await redis.xlen(KEYS.requests) == 0  # not the first three of four
            assert not [k async for k in redis.scan_iter(KEYS.status("*"))]


async def test_a_repeat_after_the_result_expired_is_not_run_again(
        app, api: httpx.AsyncClient, redis: Redis, null_worker) -> None:
    """The key is kept as long as an unfinished request (status_ttl_s), the result only for its
    retention: a repeat in between finds no status. It was run already, so it is answered 410
    (the key still names it), never admitted again under its id."""
    headers = {"Idempotency-Key": "order-44"}
    first = await api.post("/v1/requests", json=BODY, headers=headers)
    assert first.status_code == 202, first.text
    rid = first.json()["id"]
    done = await api.get(f"/v1/requests/{rid}", params={"wait": 30})
    assert done.json()["status"] == "done", done.text
    await redis.delete(KEYS.status(rid), KEYS.reply(rid))  # the result's retention ran out
    for _ in range(2):  # the answer holds: the repeat neither runs it nor frees the key
        again = await api.post("/v1/requests", json=BODY, headers=headers)
        assert again.status_code == 410, again.text
        assert again.json()["error"]["code"] == "expired" and rid in again.json()["error"]["message"]
        assert await redis.xlen(KEYS.requests) == 0
        assert not await redis.exists(KEYS.status(rid))
    # another key is another request
    other = await api.post("/v1/requests", json=BODY, headers={"Idempotency-Key": "order-45"})
    assert other.status_code == 202 and other.json()["id"] != rid


async def test_only_a_keyed_request_leaves_its_admitted_mark(api: httpx.AsyncClient, redis: Redis) -> None:
    plain = await api.post("/v1/requests", json=BODY)
    keyed = await api.post("/v1/requests", json=BODY, headers={"Idempotency-Key": "order-46"})
    assert not await redis.exists(KEYS.admitted(plain.json()["id"]))
    # when each expires (absolute times: the two keys may be on two nodes of a cluster)
    mark = await redis.execute_command("PEXPIRETIME", KEYS.admitted(keyed.json()["id"]))
    key = await redis.execute_command("PEXPIRETIME", idempotency("anonymous:order-46"))
    assert 0 < key <= mark <= key + 1000  # as long as the key (set a moment after it)
