"""require_key and require_admin on a bare app: who is let in, with which scope, and the answers
(401 with WWW-Authenticate, 403 naming the admin scope) for everyone else."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import Depends, FastAPI

from sluice.api.auth import ANONYMOUS, Caller, digest, key_digests, require_admin, require_key
from sluice.api.errors import install


class _State:
    def __init__(self, keys: list[str]) -> None:
        self.key_digests = key_digests(keys)


def build(keys: list[str]) -> FastAPI:
    app = FastAPI()
    install(app)
    app.state.sluice = _State(keys)

    @app.get("/who")
    async def who(caller: Caller = Depends(require_key)) -> dict:
        return {"digest": caller.digest, "scope": caller.scope}

    @app.get("/admin", dependencies=[Depends(require_admin)])
    async def admin() -> dict:
        return {"ok": True}

    return app


@pytest.fixture
async def keyed() -> AsyncIterator[httpx.AsyncClient]:
    app = build(["admin:root", "user:alice", f"sha256:{digest('bob')}"])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        yield client


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_each_key_is_its_caller_with_its_scope(keyed: httpx.AsyncClient) -> None:
    assert (await keyed.get("/who", headers=bearer("root"))).json() == {"digest": digest("root"), "scope": "admin"}
    assert (await keyed.get("/who", headers=bearer("alice"))).json() == {"digest": digest("alice"), "scope": "user"}
    assert (await keyed.get("/who", headers=bearer("bob"))).json()["scope"] == "user"  # stored as a digest


@pytest.mark.parametrize(("headers", "message"), [
    ({}, "missing API key"),
    (bearer("mallory"), "invalid API key"),
    (bearer(digest("alice")), "invalid API key"),  # the digest is not the key
    ({"Authorization": "Basic YWxpY2U6"}, "missing API key"),
    ({"Authorization": "Bearer"}, "missing API key"),
])
async def test_a_missing_or_unknown_key_is_a_401(keyed: httpx.AsyncClient, headers: dict, message: str) -> None:
    r = await keyed.get("/who", headers=headers)
    assert r.status_code == 401, r.text
    assert r.headers["WWW-Authenticate"] == "Bearer"
    assert message in r.json()["error"]["message"] and r.json()["error"]["type"] == "authentication_error"


async def test_admin_routes_need_an_admin_key(keyed: httpx.AsyncClient) -> None:
    assert (await keyed.get("/admin", headers=bearer("root"))).status_code == 200
    r = await keyed.get("/admin", headers=bearer("alice"))
    assert r.status_code == 403 and "admin" in r.json()["error"]["message"]
    assert (await keyed.get("/admin")).status_code == 401  # no key: who, before what


async def test_without_keys_the_caller_is_anonymous_and_may_do_everything() -> None:
    app = build([])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as anyone:
        assert (await anyone.get("/who")).json() == {"digest": None, "scope": "admin"}
        assert (await anyone.get("/admin", headers=bearer("whatever"))).status_code == 200


def test_ownership() -> None:
    alice, bob = Caller(digest("alice"), "user"), Caller(digest("bob"), "user")
    assert alice.owns(digest("alice")) and not alice.owns(digest("bob"))
    assert not alice.owns(None)  # what no key made belongs to no user key
    assert not bob.owns(digest("alice"))
    assert Caller(digest("root"), "admin").owns(digest("alice"))
    assert ANONYMOUS.owns(None) and ANONYMOUS.admin
    assert not Caller(None, "user").owns(None)
