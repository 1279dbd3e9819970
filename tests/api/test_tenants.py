"""Tenants at the api: keys from a keys file carry their tenant onto every request, a sharing
tenant's keys see each other's work, and a tenant's requests and tokens per minute answer 429
with Retry-After and OpenAI's x-ratelimit-* headers (on success too); the tokens charged at
admission are settled against the tokens used when the final is written."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from sluice.api.auth import digest
from sluice.api.tenant_limits import duration
from sluice.broker.keys import ModelKeys
from sluice.config.settings import Settings
from sluice.config.tenants import key_tenant
from sluice.protocol.openai_responses import request_id as response_request
from tests.api.conftest import MODELS_YAML, http_client, running_app
from tests.broker.helpers import MODEL

ADMIN, ALICE, ALAN, BOB = "admin-key", "alice-key", "alan-key", "bob-key"


def keys_file(path: Path, tenants: dict[str, dict[str, Any]]) -> Path:
    """acme (alice, alan), lab (bob), ops (the admin); `tenants` sets their configuration."""
    entries = [(ADMIN, "admin", "ops"), (ALICE, "user", "acme"), (ALAN, "user", "acme"), (BOB, "user", "lab")]
    body = {"tenants": {"ops": {}, "acme": {}, "lab": {}, **tenants},
            "keys": [{"key": f"sha256:{digest(k)}", "scope": s, "tenant": t} for k, s, t in entries]}
    path.write_text(json.dumps(body))  # JSON is YAML
    return path


def tenant_settings(settings: Settings, tmp_path: Path, **tenants: dict[str, Any]) -> Settings:
    (tmp_path / "models.yaml").write_text(MODELS_YAML)
    return settings.model_copy(update={"models_file": tmp_path / "models.yaml", "api_keys": [],
                                       "keys_file": keys_file(tmp_path / "keys.yaml", tenants)})


async def submit(client: httpx.AsyncClient, max_tokens: int = 4, prompt: str = "hello") -> httpx.Response:
    return await client.post("/v1/requests", json={"prompt": prompt, "max_tokens": max_tokens})


async def test_every_request_records_its_keys_tenant(redis: Redis, settings: Settings, tmp_path: Path) -> None:
    async with running_app(tenant_settings(settings, tmp_path)) as app, http_client(app, ALICE) as alice, \
            http_client(app, BOB) as bob:
        assert app.state.tenants.get("acme").weight == 1.0 and app.state.tenants.get("nobody").queue_share == 0.5
        for client, tenant in ((alice, "acme"), (bob, "lab")):
            r = await submit(client)
            assert r.status_code == 202, r.text
            assert await entry_tenant(redis, r.json()["id"]) == tenant
        r = await alice.post(f"/v1/models/{MODEL}/infer", params={"timeout_s": 0.2},
                             json=[{"prompt": "hi", "max_tokens": 2}])
        assert r.status_code == 504, r.text  # no worker: not done within its timeout
        rid = r.json()["error"]["message"].split()[1].rstrip(":")
        assert await redis.hget(ModelKeys(MODEL).status(rid), "tenant") == "acme"
        r = await alice.post("/v1/responses", json={"model": MODEL, "input": "hi", "background": True})
        assert r.status_code == 200, r.text
        rid = str(response_request(r.json()["id"]))
        assert await entry_tenant(redis, rid) == "acme"
        assert json.loads(await redis.get(ModelKeys(MODEL).response(rid)))["tenant"] == "acme"
        assert "tenant" not in r.json()


async def entry_tenant(redis: Redis, rid: str) -> str:
    """The tenant of a queued request's entry (wherever fair share put it) and of its status."""
    status = await redis.hgetall(ModelKeys(MODEL).status(rid))
    if status.get("entry") and status.get("stream"):
        (_, fields), = await redis.xrange(status["stream"], status["entry"], status["entry"])
        assert json.loads(fields["data"])["tenant"] == status["tenant"]
    return status["tenant"]


async def test_old_api_keys_are_a_tenant_each(redis: Redis, settings: Settings, tmp_path: Path) -> None:
    (tmp_path / "models.yaml").write_text(MODELS_YAML)
    old = settings.model_copy(update={"models_file": tmp_path / "models.yaml", "api_keys": [f"admin:{ADMIN}", BOB]})
    async with running_app(old) as app, http_client(app, BOB) as bob:
        r = await submit(bob)
        assert r.status_code == 202, r.text
        tenant = await redis.hget(ModelKeys(MODEL).status(r.json()["id"]), "tenant")
        assert tenant == key_tenant(digest(BOB)) == f"key-{digest(BOB)[:8]}"
        assert app.state.sluice.tenants.names() == sorted(["default", tenant, key_tenant(digest(ADMIN))])


async def test_a_sharing_tenants_keys_see_and_cancel_each_others_work(
        redis: Redis, settings: Settings, tmp_path: Path) -> None:
    for share in (False, True):
        async with running_app(tenant_settings(settings, tmp_path, acme={"share": share})) as app, \
                http_client(app, ALICE) as alice, http_client(app, ALAN) as alan, http_client(app, BOB) as bob:
            rid = (await submit(alice)).json()["id"]
            assert (await bob.get(f"/v1/requests/{rid}")).status_code == 404  # another tenant: never
            assert (await alan.get(f"/v1/requests/{rid}")).status_code == (200 if share else 404)
            up = await alice.post("/v1/files", files={"file": ("in.jsonl", b'{"x": 1}\n')}, data={"purpose": "batch"})
            fid = up.json()["id"]
            assert (await alan.get(f"/v1/files/{fid}")).status_code == (200 if share else 404)
            listed = {f["id"] for f in (await alan.get("/v1/files")).json()["data"]}
            assert (fid in listed) == share
            assert (await bob.get(f"/v1/files/{fid}")).status_code == 404
            assert (await alan.delete(f"/v1/requests/{rid}")).status_code == (200 if share else 404)
            made = await alice.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions"})
            bid = made.json()["id"]
            assert await redis.hget(f"sluice:batch:{bid}", "tenant") == "acme"  # its rows will be acme's
            assert (await alan.get(f"/v1/batches/{bid}")).status_code == (200 if share else 404)
            assert (bid in {b["id"] for b in (await alan.get("/v1/batches")).json()["data"]}) == share
            assert (await bob.get(f"/v1/batches/{bid}")).status_code == 404


async def test_requests_per_minute_answer_429_with_the_headers(
        redis: Redis, settings: Settings, tmp_path: Path) -> None:
    s = tenant_settings(settings, tmp_path, acme={"requests_per_minute": 3, "tokens_per_minute": 1000})
    async with running_app(s) as app, http_client(app, ALICE) as alice, http_client(app, BOB) as bob:
        for left in (2, 1, 0):
            r = await submit(alice)
            assert r.status_code == 202, r.text
            assert r.headers["x-ratelimit-limit-requests"] == "3"
            assert r.headers["x-ratelimit-remaining-requests"] == str(left)
            assert r.headers["x-ratelimit-limit-tokens"] == "1000"
            assert r.headers["x-ratelimit-reset-requests"].endswith("s")
        refused = await submit(alice)
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["code"] == "rate_limit_exceeded"
        assert "tenant 'acme' is over its requests_per_minute limit (3)" in error["message"]
        assert int(refused.headers["Retry-After"]) >= 1
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        # the same key on the OpenAI routes, and another tenant, unaffected
        r = await alice.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 429 and r.headers["x-ratelimit-limit-requests"] == "3"
        other = await submit(bob)
        assert other.status_code == 202 and "x-ratelimit-limit-requests" not in other.headers


async def test_tokens_per_minute_count_prompt_and_max_tokens(
        redis: Redis, settings: Settings, tmp_path: Path) -> None:
    s = tenant_settings(settings, tmp_path, acme={"tokens_per_minute": 100})
    async with running_app(s) as app, http_client(app, ALICE) as alice:
        r = await submit(alice, max_tokens=60, prompt="abcd")  # 1 + 60 tokens charged
        assert r.status_code == 202 and r.headers["x-ratelimit-remaining-tokens"] == "39", r.headers
        refused = await submit(alice, max_tokens=60, prompt="abcd")
        assert refused.status_code == 429
        assert "tokens_per_minute limit (100)" in refused.json()["error"]["message"]
        assert refused.headers["x-ratelimit-remaining-tokens"] == "39"
        never = await submit(alice, max_tokens=200)
        assert never.status_code == 429 and "more than its tokens_per_minute limit" in never.json()["error"]["message"]
        assert (await submit(alice, max_tokens=30, prompt="abcd")).status_code == 202  # 31 of the 39 left


async def test_the_final_settles_the_tokens_charged_against_those_used(
        redis: Redis, settings: Settings, tmp_path: Path, redis_url: str) -> None:
    """A prompt of one long word: charged a quarter of its characters, counted one token by the
    null engine, so the final gives back nearly all of the charge, once."""
    from prometheus_client import REGISTRY

    from sluice.broker.plumbing.connection import connect
    from sluice.config.model import load_models
    from sluice.workers.engines.null import NullEngine
    from sluice.workers.worker import Worker

    s = tenant_settings(settings, tmp_path, acme={"tokens_per_minute": 4_000})
    bucket = ModelKeys(MODEL).quota("acme", "tokens")
    async with running_app(s) as app, http_client(app, ALICE) as alice:
        r = await submit(alice, max_tokens=5, prompt="a" * 12_000)  # 3,000 + 5 charged
        assert r.status_code == 202 and r.headers["x-ratelimit-remaining-tokens"] == "995", r.text
        rid = r.json()["id"]
        assert await redis.exists(ModelKeys(MODEL).charge(rid))
        charged_until = int(await redis.get(bucket))
        served_before = REGISTRY.get_sample_value("sluice_tenant_served_tokens_total",
                                                  {"tenant": "acme", "model": MODEL})
        (model,) = load_models(s.models_file)
        worker_redis = connect(redis_url, name="tenants-test-worker")
        worker = Worker(s, model, NullEngine(), worker_redis, "tenants-test-worker")
        task = asyncio.create_task(worker.run())
        try:
            done = (await alice.get(f"/v1/requests/{rid}", params={"wait": 30})).json()
        finally:
            worker.stopping.set()
            await asyncio.wait_for(task, 30)
            await worker_redis.aclose()
        assert done["status"] == "done", done
        used = done["usage"]["prompt_tokens"] + done["usage"]["completion_tokens"]
        assert used == 6
        served = REGISTRY.get_sample_value("sluice_tenant_served_tokens_total", {"tenant": "acme", "model": MODEL})
        assert served is not None and served - (served_before or 0) == used  # the worker's count, by tenant
        assert not await redis.exists(ModelKeys(MODEL).charge(rid))  # settled, and only once
        interval_ms = 60_000 / 4_000
        after = await redis.get(bucket)  # gone: the bucket is full again
        assert after is None or int(after) <= charged_until - (3005 - used) * interval_ms + 1


async def test_a_call_refused_by_the_queue_gives_its_charge_back(
        redis: Redis, settings: Settings, tmp_path: Path) -> None:
    s = tenant_settings(settings, tmp_path, acme={"requests_per_minute": 10, "tokens_per_minute": 1000})
    async with running_app(s.model_copy(update={"max_queued": 1})) as app, http_client(app, ALICE) as alice:
        assert (await submit(alice)).headers["x-ratelimit-remaining-requests"] == "9"
        full = await submit(alice)
        assert full.status_code in (429, 503), full.text
        rid = (await redis.keys(ModelKeys(MODEL).charge("*")))
        assert len(rid) == 1  # the refused call's record is gone with its charge
        await redis.delete(*await redis.keys(f"{ModelKeys(MODEL).tag}:req"))  # room again
        again = await submit(alice)
        assert again.status_code == 202 and again.headers["x-ratelimit-remaining-requests"] == "8", again.headers


async def test_a_tenants_stored_files_are_capped_by_count_and_bytes(
        redis: Redis, settings: Settings, tmp_path: Path) -> None:
    s = tenant_settings(settings, tmp_path, acme={"max_files": 2, "max_file_bytes": 100})
    async with running_app(s) as app, http_client(app, ALICE) as alice, http_client(app, ALAN) as alan:
        async def upload(client: httpx.AsyncClient, size: int) -> httpx.Response:
            line = b'{"x": "' + b"a" * (size - 10) + b'"}\n'
            return await client.post("/v1/files", files={"file": ("in.jsonl", line)}, data={"purpose": "batch"})

        first = await upload(alice, 40)
        assert first.status_code == 200, first.text
        over_bytes = await upload(alan, 70)  # the tenant's, not the key's: 40 + 70 > 100
        assert over_bytes.status_code == 429 and "max_file_bytes limit (100)" in over_bytes.json()["error"]["message"]
        assert over_bytes.headers["Retry-After"]
        assert (await upload(alan, 40)).status_code == 200
        over_count = await upload(alice, 11)
        assert over_count.status_code == 429 and "max_files limit (2)" in over_count.json()["error"]["message"]
        assert (await alice.delete(f"/v1/files/{first.json()['id']}")).status_code == 200
        assert (await upload(alice, 11)).status_code == 200
        # an api killed between a file's record and its metadata: the record is dropped once a
        # refusal is near and its metadata is found gone, never counted for ever
        lost = "file-lost"
        await redis.hset("sluice:{t:acme}:files", lost, "10 9999999999")
        assert (await upload(alice, 11)).status_code == 429  # at 2 live files, a third refused ...
        assert not await redis.hexists("sluice:{t:acme}:files", lost)  # ... and the lost one dropped
        assert await redis.hlen("sluice:{t:acme}:files") == 2


@pytest.mark.parametrize(("seconds", "shown"), [(0.02, "20ms"), (1, "1s"), (1.5, "1.5s"), (360, "6m0s"),
                                                (3723, "1h2m3s")])
def test_reset_is_in_openais_duration_format(seconds: float, shown: str) -> None:
    assert duration(seconds) == shown


async def test_a_tenants_streams_are_capped_across_api_processes(
        redis: Redis, settings: Settings, tmp_path: Path) -> None:
    s = tenant_settings(settings, tmp_path, acme={"max_streams": 1})
    async with running_app(s) as one, running_app(s) as two:
        slots_one: Any = one.state.sluice.streams
        slots_two: Any = two.state.sluice.streams
        from sluice.api.auth import caller_for
        alice = caller_for(one.state.sluice.key_digests, f"Bearer {ALICE}", one.state.sluice.tenants)
        alan = caller_for(two.state.sluice.key_digests, f"Bearer {ALAN}", two.state.sluice.tenants)
        slot = await slots_one.reserve(alice)
        with pytest.raises(Exception) as refused:
            await slots_two.reserve(alan)  # the same tenant on another api process
        assert getattr(refused.value, "status", None) == 429
        assert "max_streams limit (1)" in str(refused.value)
        slot.release()
        await asyncio.sleep(0)  # the lease's removal runs in the background
        for _ in range(100):
            if not await redis.zcard("sluice:{t:acme}:streams"):
                break
            await asyncio.sleep(0.01)
        (await slots_two.reserve(alan)).release()


async def test_an_unrefreshed_stream_lease_expires(redis: Redis) -> None:
    """A killed api's streams: their leases are not refreshed, and leave the count when they expire."""
    from sluice.broker.intake.tenant_streams import TenantStreams

    dead = TenantStreams(redis, lease_s=0.2)
    assert await dead.acquire("acme", 1)
    live = TenantStreams(redis, lease_s=30)
    assert await live.acquire("acme", 1) is None
    ttl = await redis.pttl("sluice:{t:acme}:streams")
    assert 0 < ttl <= 200  # the set itself goes with its last lease
    while await redis.exists("sluice:{t:acme}:streams"):
        await asyncio.sleep(0.05)
    assert await live.acquire("acme", 1)
    await live.refresh()
    assert await redis.pttl("sluice:{t:acme}:streams") > 20_000


async def test_the_dashboard_shows_the_tenants(redis: Redis, settings: Settings, tmp_path: Path) -> None:
    s = tenant_settings(settings, tmp_path, acme={"weight": 3, "requests_per_minute": 60, "max_files": 5})
    async with running_app(s) as app, http_client(app, ALICE) as alice, http_client(app, ADMIN) as admin:
        await submit(alice)
        await submit(alice)
        await alice.post("/v1/files", files={"file": ("in.jsonl", b'{"x": 1}\n')}, data={"purpose": "batch"})
        r = await admin.get("/v1/dashboard")
        assert r.status_code == 200, r.text
        tenants = {t["name"]: t for t in r.json()["tenants"]}
        assert set(tenants) == {"acme", "lab", "ops", "default"}  # the configured names only
        acme = tenants["acme"]
        assert (acme["weight"], acme["requests_per_minute"], acme["max_files"]) == (3, 60, 5)
        assert acme["queued"] == {MODEL: 2} and acme["files"] == 1 and acme["file_bytes"] == 9
        assert tenants["lab"]["queued"] == {MODEL: 0}
        page = (await admin.get("/dashboard")).text
        assert 'id="tenants"' in page and "renderTenants" in page


async def test_refusals_are_counted_per_tenant_and_reason(redis: Redis, settings: Settings, tmp_path: Path) -> None:
    from prometheus_client import REGISTRY

    def refused(reason: str) -> float:
        return REGISTRY.get_sample_value("sluice_tenant_requests_refused_total",
                                         {"tenant": "acme", "reason": reason}) or 0.0

    s = tenant_settings(settings, tmp_path, acme={"requests_per_minute": 1})
    async with running_app(s) as app, http_client(app, ALICE) as alice:
        before = refused("requests_per_minute")
        assert (await submit(alice)).status_code == 202
        assert (await submit(alice)).status_code == 429
        assert refused("requests_per_minute") == before + 1


async def test_metrics_show_what_each_tenant_holds_queued(redis: Redis, settings: Settings, tmp_path: Path) -> None:
    async with running_app(tenant_settings(settings, tmp_path)) as app, http_client(app, ALICE) as alice, \
            http_client(app, ADMIN) as admin:
        for _ in range(3):
            await submit(alice)
        text = (await admin.get("/metrics")).text
        assert f'sluice_tenant_queued{{model="{MODEL}",tenant="acme"}} 3.0' in text
        assert f'sluice_tenant_queued{{model="{MODEL}",tenant="lab"}} 0.0' in text


async def test_a_route_naming_its_model_refuses_a_tenant_out_of_requests_before_its_body(
        redis: Redis, settings: Settings, tmp_path: Path) -> None:
    s = tenant_settings(settings, tmp_path, acme={"requests_per_minute": 1})
    async with running_app(s) as app, http_client(app, ALICE) as alice:
        assert (await submit(alice)).status_code == 202  # the minute's one request
        r = await alice.post(f"/v1/models/{MODEL}/infer", content=b"not json at all",
                             headers={"content-type": "application/json"})
        assert r.status_code == 429, r.text  # not 400: the body was never read
        assert "requests_per_minute limit (1)" in r.json()["error"]["message"] and int(r.headers["Retry-After"]) >= 1
        entries = await redis.xlen(ModelKeys(MODEL).requests)
        assert entries <= 1
