"""API keys, idempotency keys under concurrent repeats, and a Redis that wants a password."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis as redis_sync

from sluice.broker.keys import ModelKeys
from tests.e2e.conftest import null_stack, settled_log, wait_done

MODELS = "models:\n  - name: acc\n    continuous_batching_config: {max_concurrent_batch_size: 8}\n"
KEY = "s3cret-key"  # a user key
ADMIN_KEY = "admin-s3cret"


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    with null_stack(tmp_path_factory.mktemp("acc"), MODELS, "acc", password="redis-pass",
                    SLUICE_API_KEYS=f"admin:{ADMIN_KEY},user:{KEY}") as stack:
        assert ":redis-pass@" in stack.redis.url
        yield stack.url, stack.redis.url


async def test_api_keys(secured: tuple[str, str]) -> None:
    url, _ = secured
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        assert (await client.get("/healthz")).status_code == 200  # probes need no key
        r = await client.post("/v1/requests", json={"prompt": "hi"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        r = await client.post("/v1/requests", json={"prompt": "hi"}, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401 and "invalid" in r.json()["error"]["message"]
        assert (await client.get("/v1/models")).status_code == 401
        auth = {"Authorization": f"Bearer {KEY}"}
        r = await client.post("/v1/requests", json={"prompt": "hi", "max_tokens": 2}, headers=auth)
        assert r.status_code == 202
        client.headers.update(auth)
        assert (await wait_done(client, r.json()["id"]))["status"] == "done"  # through a password-protected Redis
        assert (await client.get("/v1/workers")).status_code == 403  # host names and pids: admin only
        assert (await client.get("/v1/workers", headers={"Authorization": f"Bearer {ADMIN_KEY}"})).status_code == 200
        assert (await client.get(f"/v1/requests/{r.json()['id']}", headers={
            "Authorization": f"Bearer {ADMIN_KEY}"})).json()["status"] == "done"  # admins see every request


async def test_idempotency_key_under_concurrent_repeats(secured: tuple[str, str]) -> None:
    url, redis_url = secured
    headers = {"Authorization": f"Bearer {KEY}", "Idempotency-Key": "order-42"}
    async with httpx.AsyncClient(base_url=url, timeout=30, headers=headers) as client:
        answers = await asyncio.gather(*(
            client.post("/v1/requests", json={"prompt": "once", "max_tokens": 2}) for _ in range(20)))
        assert {r.status_code for r in answers} == {202}
        ids = {r.json()["id"] for r in answers}
        assert len(ids) == 1
        (rid,) = ids
        assert (await wait_done(client, rid))["status"] == "done"
        again = await client.post("/v1/requests", json={"prompt": "once", "max_tokens": 2})
        assert again.json() == {"id": rid, "status": "done", "model": "acc"}
        other = await client.post("/v1/requests", json={"prompt": "once", "max_tokens": 2},
                                  headers={"Idempotency-Key": "order-43"})
        assert other.json()["id"] != rid
    r = redis_sync.Redis.from_url(redis_url, decode_responses=True)
    assert len(settled_log(r, ModelKeys("acc").log, {rid})) == 1  # enqueued and run once


async def test_huge_bodies_and_wrong_content_types(secured: tuple[str, str]) -> None:
    url, _ = secured
    auth = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=url, timeout=30, headers=auth) as client:
        huge = b'{"prompt": "' + b"x" * (9 * 1024 * 1024) + b'"}'
        r = await client.post("/v1/requests", content=huge, headers={"content-type": "application/json"})
        assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]

        async def chunks():
            for _ in range(10):
                yield b"x" * (1024 * 1024)

        r = await client.post("/v1/models/acc/infer", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        r = await client.post("/v1/requests", content=b"prompt=hi", headers={"content-type": "text/plain"})
        assert 400 <= r.status_code < 500
        r = await client.post("/v1/requests", json={"prompt": "x" * 300_000})
        assert r.status_code == 413 and "prompt" in r.json()["error"]["message"]


def test_redis_over_tls(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    with null_stack(tmp_path, MODELS, "acc", password="tls-pass", tls=(cert, key)) as stack:
        assert stack.redis.url.startswith("rediss://")
        with httpx.Client(base_url=stack.url, timeout=30) as client:
            rid = client.post("/v1/requests", json={"prompt": "secure", "max_tokens": 2}).json()["id"]
            result = client.get(f"/v1/requests/{rid}", params={"wait": 20}).json()
        assert result["status"] == "done" and result["output"]["num_output_tokens"] == 2
