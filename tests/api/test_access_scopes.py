"""Key scopes: a user key is refused the admin routes, an admin key passes; key entries; the api
refuses to listen publicly without keys; `sluice keys new` makes a key that works."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import uvicorn
from redis.asyncio import Redis
from typer.testing import CliRunner

from sluice.api.auth import anonymous_listen_error, digest, key_digests, parse_key
from sluice.broker.registry import WorkerInfo, WorkerRegistry
from sluice.cli import up
from sluice.cli.main import app as cli
from sluice.config.model import ConfigError
from sluice.config.settings import Settings
from sluice.supervisor.processes import free_port
from tests.api.keyed_app import ADMIN, ALICE, BOB, client, keyed_app
from tests.broker.helpers import MODEL

ADMIN_ROUTES = [("PUT", f"/v1/models/{MODEL}/config", {"batch_config": "single"}),
                ("GET", f"/v1/models/{MODEL}/logs", None),
                ("GET", "/v1/workers", None)]


async def beat(redis: Redis) -> None:
    now = time.time()
    await WorkerRegistry(redis).beat(WorkerInfo(name="gpu-host-7-m", model=MODEL, version=1, mode="continuous",
                                                pid=4242, host="gpu-host-7", in_flight=0, capacity=4,
                                                started_at=now, heartbeat_at=now))


async def test_a_user_key_is_refused_the_admin_routes_and_an_admin_key_passes(
        redis: Redis, settings: Settings, tmp_path: Path) -> None:
    await beat(redis)
    async with keyed_app(settings, tmp_path) as app:
        async with client(app, None) as anyone:
            assert (await anyone.get("/healthz")).status_code == 200  # probes need no key
            assert (await anyone.get("/readyz")).status_code != 401
            assert (await anyone.get("/v1/workers")).status_code == 401
        for key in (ALICE, BOB):
            async with client(app, key) as user:
                for method, url, body in ADMIN_ROUTES:
                    r = await user.request(method, url, json=body)
                    assert r.status_code == 403, (key, url, r.text)
                    assert "admin" in r.json()["error"]["message"]
                # Users still use the model; worker names (host names) are for admins.
                model = (await user.get(f"/v1/models/{MODEL}")).json()
                assert model["workers"] == [{"version": 1, "in_flight": 0}]
        async with client(app, ADMIN) as admin:
            for method, url, body in ADMIN_ROUTES:
                r = await admin.request(method, url, json=body)
                assert r.status_code == 200, (url, r.text)
            assert (await admin.get("/v1/workers")).json()["workers"][0]["host"] == "gpu-host-7"
            assert (await admin.get(f"/v1/models/{MODEL}")).json()["workers"][0]["name"] == "gpu-host-7-m"


async def test_without_keys_everything_is_open(redis: Redis, settings: Settings, tmp_path: Path) -> None:
    async with keyed_app(settings, tmp_path, keys=[]) as app, client(app, None) as anyone:
        for method, url, body in ADMIN_ROUTES:
            assert (await anyone.request(method, url, json=body)).status_code == 200, url


def test_key_entries_carry_a_scope_and_a_bare_entry_is_a_user_key() -> None:
    hexd = digest("k")
    assert parse_key("k") == (hexd, "user")
    assert parse_key("user:k") == (hexd, "user")
    assert parse_key("admin:k") == (hexd, "admin")
    assert parse_key(f"sha256:{hexd}") == (hexd, "user")
    assert parse_key(f"admin:sha256:{hexd.upper()}") == (hexd, "admin")
    assert parse_key("other:k") == (digest("other:k"), "user")  # not a scope: part of the key
    for bad in ("admin:sha256:abc", "admin:", "user:sha256:" + "g" * 64):
        with pytest.raises(ConfigError):
            parse_key(bad)
    with pytest.raises(ConfigError, match="both user and admin"):
        key_digests(["user:k", "admin:k"])
    assert key_digests(["admin:a", "b"]) == {digest("a"): "admin", digest("b"): "user"}


def test_listening_publicly_needs_keys_or_allow_anonymous() -> None:
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        assert anonymous_listen_error(host, [], False) is None, host
    for host in ("0.0.0.0", "::", "10.1.2.3", "api.example.com"):
        error = anonymous_listen_error(host, [], False)
        assert error and "SLUICE_API_KEYS" in error and "--allow-anonymous" in error, host
        assert anonymous_listen_error(host, ["admin:k"], False) is None
        assert anonymous_listen_error(host, [], True) is None


def test_sluice_api_on_a_public_address_without_keys_exits_with_both_fixes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SLUICE_API_KEYS", "SLUICE_ALLOW_ANONYMOUS", "SLUICE_API_HOST"):
        monkeypatch.delenv(name, raising=False)

    def served(*_args: object, **_kw: object) -> None:
        raise AssertionError("went on to serve")

    monkeypatch.setattr(uvicorn, "run", served)
    done = CliRunner().invoke(cli, ["api", "--host", "0.0.0.0", "--port", str(free_port())])
    assert done.exit_code == 2, done.output
    assert "SLUICE_API_KEYS" in done.output and "--allow-anonymous" in done.output, done.output


def test_sluice_up_on_a_public_address_without_keys_starts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLUICE_API_KEYS", raising=False)

    def started(*_args: object, **_kw: object) -> None:
        raise AssertionError("went on to start the stack")

    monkeypatch.setattr(up, "load_models", started)
    assert up.run_up(None, "0.0.0.0", free_port(), None) == 2


@pytest.mark.parametrize("scope", ["user", "admin"])
async def test_sluice_keys_new_prints_a_key_that_works(
        scope: str, redis: Redis, settings: Settings, tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["keys", "new", "--scope", scope])
    assert result.exit_code == 0, result.output
    printed = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    key, entry = printed["key"], printed["SLUICE_API_KEYS"]
    assert entry == f"{scope}:sha256:{digest(key)}" and key not in entry
    async with keyed_app(settings, tmp_path, keys=[entry]) as app, client(app, key) as holder:
        r = await holder.post("/v1/requests", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 202, r.text
        assert (await holder.get("/v1/workers")).status_code == (200 if scope == "admin" else 403)
