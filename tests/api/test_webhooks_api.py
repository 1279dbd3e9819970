"""`/v1/webhooks` (api/webhooks.py): admin keys only; the secret shown at creation and rotation,
never in a listing; private addresses refused unless allowed; a request of an owner with an
endpoint carries the webhook mark from then on."""

from __future__ import annotations

from pathlib import Path

from redis.asyncio import Redis

from sluice.api.auth import digest
from sluice.broker.webhooks.outbox import OWNERS
from sluice.config.settings import Settings
from tests.api.keyed_app import ADMIN, ALICE, client, keyed_app
from tests.broker.helpers import KEYS, MODEL

URL = "http://127.0.0.1:9/hooks"


async def test_only_admin_keys_manage_endpoints_and_private_urls_are_refused(settings: Settings, tmp_path: Path,
                                                                           redis: Redis) -> None:
    async with keyed_app(settings, tmp_path) as app, client(app, ADMIN) as admin, client(app, ALICE) as alice:
        assert (await alice.post("/v1/webhooks", json={"url": URL})).status_code == 403
        assert (await alice.get("/v1/webhooks")).status_code == 403
        refused = await admin.post("/v1/webhooks", json={"url": URL})
        assert refused.status_code == 400 and "SLUICE_WEBHOOKS_ALLOW_PRIVATE" in refused.json()["error"]["message"]
        for body, param in (({"url": "ftp://example.com/x"}, "url"), ({"url": "http://u:p@example.com/"}, "url"),
                            ({"url": "http://169.254.169.254/latest"}, "url"), ({"url": "http://[::1]:8/"}, "url"),
                            ({"url": "https://example.com/", "events": ["request.done"]}, "events"),
                            ({"url": "https://example.com/", "owner": "alice"}, "owner")):
            answer = await admin.post("/v1/webhooks", json=body)
            assert answer.status_code == 400 and answer.json()["error"]["param"] == param, (body, answer.text)
        assert (await admin.post("/v1/webhooks", json={"url": URL, "colour": "red"})).status_code == 422
        assert await redis.hlen(OWNERS) == 0


async def test_create_list_rotate_disable_delete(settings: Settings, tmp_path: Path, redis: Redis) -> None:
    async with keyed_app(settings, tmp_path, webhooks_allow_private=True) as app, client(app, ADMIN) as admin:
        made = await admin.post("/v1/webhooks", json={"url": URL, "events": ["request.completed"],
                                                      "owner": digest(ALICE)})
        assert made.status_code == 201, made.text
        endpoint = made.json()
        assert endpoint["secret"].startswith("whsec_") and endpoint["enabled"] and endpoint["owner"] == digest(ALICE)
        assert await redis.hgetall(OWNERS) == {digest(ALICE): "1"}
        (listed,) = (await admin.get("/v1/webhooks")).json()["data"]
        assert "secret" not in listed and listed["id"] == endpoint["id"]
        assert "secret" not in (await admin.get(f"/v1/webhooks/{endpoint['id']}")).json()
        rotated = (await admin.post(f"/v1/webhooks/{endpoint['id']}/rotate")).json()
        assert rotated["secret"].startswith("whsec_") and rotated["secret"] != endpoint["secret"]
        assert not (await admin.post(f"/v1/webhooks/{endpoint['id']}/disable")).json()["enabled"]
        assert await redis.hlen(OWNERS) == 0
        assert (await admin.post(f"/v1/webhooks/{endpoint['id']}/enable")).json()["enabled"]
        assert (await admin.post(f"/v1/webhooks/{endpoint['id']}/test")).status_code == 202
        assert (await admin.delete(f"/v1/webhooks/{endpoint['id']}")).json()["deleted"] is True
        for method, path in (("GET", ""), ("DELETE", ""), ("POST", "/rotate"), ("POST", "/disable")):
            gone = await admin.request(method, f"/v1/webhooks/{endpoint['id']}{path}")
            assert gone.status_code == 404, (method, path)
        assert await redis.hlen(OWNERS) == 0


async def test_a_request_of_an_owner_with_an_endpoint_carries_the_mark(settings: Settings, tmp_path: Path,
                                                                    redis: Redis) -> None:
    async with keyed_app(settings, tmp_path, webhooks_allow_private=True) as app, \
            client(app, ADMIN) as admin, client(app, ALICE) as alice:
        assert (await admin.post("/v1/webhooks", json={"url": URL, "owner": digest(ALICE)})).status_code == 201
        mine = (await alice.post("/v1/requests", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})).json()
        theirs = (await admin.post("/v1/requests", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})).json()
        assert await redis.hget(KEYS.status(mine["id"]), "hook") == "1"
        assert await redis.hget(KEYS.status(theirs["id"]), "hook") is None
