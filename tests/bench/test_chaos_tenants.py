"""Tenants in `sluice bench chaos` (bench/chaos_tenants.py): the keys file is one the api loads,
with each tenant's key, weight and an admin key; the audit finds a request stored under another
tenant than its client's; the receiver verifies each POST with the secret of the endpoint it was
sent to and finds an event at another tenant's endpoint; the wait for the last events counts the
outbox entries not yet fanned out. (tests/faults/test_chaos.py runs it all.)"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from sluice.api.auth import caller_for, digest, load_keys
from sluice.bench.chaos_audit import Tracked, audit, broken
from sluice.bench.chaos_tenants import Tenancy
from sluice.bench.chaos_webhooks import HookReceiver, audit_webhooks, undelivered
from sluice.broker.keys import ModelKeys
from sluice.broker.plumbing.urls import sync_connect
from sluice.broker.webhooks.endpoints import Endpoint
from sluice.broker.webhooks.outbox import GROUP, outbox
from sluice.config.settings import Settings
from sluice.protocol.webhooks import payload
from sluice.workers.webhooks.post import signed_headers

pytestmark = pytest.mark.timeout(60)
MODEL = "m"
SECRETS = {"t0": "whsec_" + "QUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFB", "t1": "whsec_" + "QkJCQkJCQkJCQkJCQkJCQkJCQkJCQkJC"}


def test_the_keys_file_gives_each_tenant_a_key_and_a_weight_and_an_admin_key(tmp_path: Path) -> None:
    tenancy = Tenancy.of(3)
    path = tenancy.write(tmp_path / "keys.yaml")
    assert path is not None
    scopes, tenants = load_keys(Settings(keys_file=path))
    for c, (name, weight) in enumerate((("t0", 1), ("t1", 2), ("t2", 1), ("t0", 1))):
        assert tenancy.of_client(c) == name
        caller = caller_for(scopes, tenancy.headers(name)["Authorization"], tenants)
        assert (caller.tenant, caller.scope, caller.digest) == (name, "user", tenancy.owner(name))
        assert tenants.get(name).weight == weight
    admin = caller_for(scopes, tenancy.admin_headers()["Authorization"], tenants)
    assert admin.admin and admin.tenant == "ops"
    assert len({tenancy.owner(t) for t in tenancy.names} | {digest(tenancy.admin_key)}) == 4


@pytest.mark.parametrize("n", [0, 1])
def test_no_tenants_no_keys(tmp_path: Path, n: int) -> None:
    tenancy = Tenancy.of(n)
    assert tenancy.write(tmp_path / "keys.yaml") is None and not (tmp_path / "keys.yaml").exists()
    assert tenancy.of_client(5) == "default" and tenancy.headers("default") == {} and tenancy.owner("default") == ""
    assert tenancy.admin_headers() == {}


async def _done(redis: Redis, rid: str, tenant: str) -> None:
    keys = ModelKeys(MODEL)
    await redis.hset(keys.status(rid), mapping={"state": "done", "tenant": tenant})
    await redis.xadd(keys.reply(rid), {"kind": "final", "data": json.dumps(
        {"status": "done", "attempt": 1, "output": {"text": ""}})})


async def test_the_audit_finds_a_request_stored_under_another_tenant(redis: Redis, redis_url: str) -> None:
    await _done(redis, "req-1", "t0")
    await _done(redis, "req-2", "t1")
    await _done(redis, "req-3", "t0")  # its client sent it as t1
    tracked = [Tracked("req-1", MODEL, "stream", None, 1, tenant="t0"),
               Tracked("req-2", MODEL, "stream", None, 1, tenant="t1"),
               Tracked("req-3", MODEL, "stream", None, 1, tenant="t1")]
    found = audit(redis_url, tracked)
    f = found["figures"]
    assert f["by_tenant"] == {"t0": {"accepted": 1, "done": 1, "diverged": 0, "mismatch": 0},
                              "t1": {"accepted": 2, "done": 2, "diverged": 0, "mismatch": 1}}, f
    assert f["tenant_mismatch"] == 1 and f["lost"] == 0 and f["done"] == 3
    assert [row["rid"] for row in found["broken"]] == ["req-3"]
    assert found["broken"][0]["broken"] == ["tenant: stored as 't0', sent as 't1'"]
    assert broken(f)
    assert not broken(audit(redis_url, tracked[:2])["figures"])


def _post(receiver: HookReceiver, path: str, secret: str, event_id: str, object_id: str) -> int:
    body = payload(event_id, "request", "done", object_id, 0, {"model": MODEL})
    headers = signed_headers(Endpoint("we_1", "", [], "", secret), event_id, body, time.time())
    return httpx.post(receiver.url.removesuffix("/hooks") + path, content=body, headers=headers, timeout=5).status_code


async def test_each_post_is_verified_at_its_endpoint_and_must_be_of_its_tenant(redis: Redis, redis_url: str) -> None:
    await _done(redis, "req-1", "t0")
    await _done(redis, "req-2", "t1")
    receiver = HookReceiver(redis_url, fail_share=0, secrets=dict(SECRETS))
    assert receiver.url_for("t0") == receiver.url + "/t0" and receiver.url_for("") == receiver.url
    try:
        assert _post(receiver, "/hooks/t0", SECRETS["t0"], "msg_1", "req-1") == 200
        assert _post(receiver, "/hooks/t1", SECRETS["t1"], "msg_2", "req-2") == 200
        assert _post(receiver, "/hooks/t1", SECRETS["t1"], "msg_3", "req-1") == 200  # t0's request at t1's
        assert _post(receiver, "/hooks/t1", SECRETS["t0"], "msg_4", "req-2") == 400  # another endpoint's secret
        assert _post(receiver, "/hooks/t9", SECRETS["t0"], "msg_5", "req-2") == 400  # no such endpoint
    finally:
        receiver.stop()
    tracked = [Tracked("req-1", MODEL, "stream", None, 1, tenant="t0"),
               Tracked("req-2", MODEL, "stream", None, 1, tenant="t1")]
    found = audit_webhooks(redis_url, receiver, tracked)
    f, lines = found["figures"], found["broken"]
    assert f["wrong_endpoint"] == 1 and f["bad_signatures"] == 2 and f["by_endpoint"] == {"t0": 1, "t1": 2}, found
    assert "wrong endpoint: req-1 of tenant t0 posted to the endpoint of ['t1']" in lines
    assert any(b.startswith("duplicate with another webhook-id: req-1") for b in lines)
    assert sum(b.startswith("bad signature: msg_4 at /hooks/t1") or b.startswith("bad signature: msg_5 at /hooks/t9")
               for b in lines) == 2, lines


async def test_an_outbox_entry_fanned_out_and_acknowledged_is_not_waited_for(redis: Redis, redis_url: str) -> None:
    """A sender killed between its XACK and its XDEL leaves a delivered entry on the outbox: the
    chaos run's wait for the rest counts what is unread or unacknowledged, not the length."""
    stream = outbox(ModelKeys(MODEL))
    r = sync_connect(redis_url)
    assert undelivered(r, stream) == 0  # no outbox yet
    ids = [await redis.xadd(stream, {"id": f"req-{i}", "state": "done"}) for i in range(4)]
    assert undelivered(r, stream) == 4  # no group yet
    await redis.xgroup_create(stream, GROUP, id="0")
    await redis.xreadgroup(GROUP, "s1", {stream: ">"}, count=2)
    await redis.xack(stream, GROUP, ids[0])  # ids[0] acknowledged, not deleted; ids[1] pending
    assert await redis.xlen(stream) == 4 and undelivered(r, stream) == 3
    await redis.xreadgroup(GROUP, "s1", {stream: ">"}, count=2)
    await redis.xack(stream, GROUP, *ids[1:])
    await redis.xdel(stream, *ids[1:])
    assert await redis.xlen(stream) == 1 and undelivered(r, stream) == 0
