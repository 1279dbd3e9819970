"""The keys file: what it accepts, and a clear error naming the file and the problem for what it
does not; SLUICE_API_KEYS' keys each become a tenant of their own."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.api.auth import caller_for, digest, load_keys
from sluice.config.model import ConfigError
from sluice.config.settings import Settings
from sluice.config.tenants import DEFAULTS, TenantsError, build_tenants, key_tenant, read_keys_file

D1, D2 = digest("one"), digest("two")

GOOD = f"""
tenants:
  acme: {{weight: 3, queue_share: 0.25, share: true, requests_per_minute: 60, tokens_per_minute: 90000,
          max_streams: 5, max_files: 10, max_file_bytes: 1000000}}
  lab: {{}}
keys:
  - {{key: "sha256:{D1}", scope: admin, tenant: acme}}
  - {{key: "SHA256:{D2.upper()}", tenant: lab}}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    return path


def test_a_keys_file_gives_each_key_its_scope_and_tenant(tmp_path: Path) -> None:
    parsed = read_keys_file(write(tmp_path, GOOD))
    acme = parsed.tenants["acme"]
    assert (acme.weight, acme.queue_share, acme.share, acme.requests_per_minute, acme.max_streams) == (3, 0.25, True,
                                                                                                      60, 5)
    assert parsed.tenants["lab"] == DEFAULTS and DEFAULTS.weight == 1 and DEFAULTS.queue_share == 0.5
    assert [(k.digest, k.scope, k.tenant) for k in parsed.keys] == [(D1, "admin", "acme"), (D2, "user", "lab")]


@pytest.mark.parametrize(("text", "named"), [
    ("keys: [", "not YAML"),
    ("- just a list", "must be a mapping"),
    ("tenants: {acme: {}}\nkeys: [{key: plain-key, tenant: acme}]", "keys.0.key: must be sha256:<64 hex digits>"),
    (f"tenants: {{}}\nkeys: [{{key: 'sha256:{D1}', tenant: acme}}]", "tenant 'acme' is not under `tenants:`"),
    (f"tenants: {{a: {{}}}}\nkeys: [{{key: 'sha256:{D1}', tenant: a}}, {{key: 'sha256:{D1}', tenant: a}}]",
     "the same key is listed twice"),
    ("tenants: {acme: {weight: 0}}", "tenants.acme.weight"),
    ("tenants: {acme: {queue_share: 1.5}}", "tenants.acme.queue_share"),
    ("tenants: {acme: {requests_per_minute: -1}}", "tenants.acme.requests_per_minute"),
    ("tenants: {acme: {rpm: 5}}", "tenants.acme.rpm: Extra inputs are not permitted"),
    ("tenants: {'a{b}': {}}", "tenant name 'a{b}'"),
    (f"tenants: {{acme: {{}}}}\nkeys: [{{key: 'sha256:{D1}', scope: root, tenant: acme}}]", "keys.0.scope"),
])
def test_a_bad_keys_file_is_refused_naming_the_file_and_the_problem(tmp_path: Path, text: str, named: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(TenantsError) as refused:
        read_keys_file(path)
    assert str(path) in str(refused.value) and named in str(refused.value), str(refused.value)


def test_a_missing_keys_file_stops_the_start(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be read"):
        load_keys(Settings(keys_file=tmp_path / "nowhere.yaml"))


def test_old_api_keys_map_to_a_tenant_each_beside_the_file(tmp_path: Path) -> None:
    settings = Settings(api_keys=["admin:root", "bob", f"user:sha256:{D2}"], keys_file=write(tmp_path, GOOD))
    scopes, tenants = load_keys(settings)
    assert scopes[digest("bob")] == "user" and scopes[D1] == "admin"
    bob = caller_for(scopes, "Bearer bob", tenants)
    assert bob.tenant == key_tenant(digest("bob")) == f"key-{digest('bob')[:8]}" and not bob.shares
    assert tenants.tenant_of(D2) == "lab"  # listed in both: the file's tenant
    assert caller_for(scopes, "Bearer one", tenants).peers == {D1}  # acme shares
    assert caller_for({}, "", tenants).tenant == "default"
    assert tenants.get("unknown") == DEFAULTS
    assert set(tenants.names()) == {"acme", "lab", "default", key_tenant(digest("root")), key_tenant(digest("bob"))}


def test_a_key_with_two_scopes_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="admin there and user in SLUICE_API_KEYS"):
        load_keys(Settings(api_keys=["one"], keys_file=write(tmp_path, GOOD)))


def test_build_tenants_without_a_file() -> None:
    tenants = build_tenants([D1], None)
    assert tenants.tenant_of(D1) == key_tenant(D1) and tenants.tenant_of(None) == "default"


def test_sluice_keys_new_prints_the_keys_file_entry(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from sluice.cli.main import app as cli

    result = CliRunner().invoke(cli, ["keys", "new", "--tenant", "acme", "--scope", "admin"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    key = lines[0].removeprefix("key=")
    (entry,) = [line for line in lines if line.startswith("- ")]
    assert key not in entry and any(line == f"SLUICE_API_KEYS=admin:sha256:{digest(key)}" for line in lines)
    parsed = read_keys_file(write(tmp_path, f"tenants: {{acme: {{}}}}\nkeys:\n  {entry}\n"))
    assert [(k.digest, k.scope, k.tenant) for k in parsed.keys] == [(digest(key), "admin", "acme")]
    refused = CliRunner().invoke(cli, ["keys", "new", "--tenant", "a b"])
    assert refused.exit_code != 0


def test_the_api_does_not_start_with_a_bad_keys_file(tmp_path: Path) -> None:
    from sluice.api.app import create_app

    path = write(tmp_path, "tenants: {acme: {weight: -1}}")
    with pytest.raises(ConfigError) as refused:
        create_app(Settings(keys_file=path))
    assert str(path) in str(refused.value) and "tenants.acme.weight" in str(refused.value)
