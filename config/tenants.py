"""Tenants: named groups of API keys, each with its share of the engine and its limits.

A keys file (YAML, named by SLUICE_KEYS_FILE) lists the keys, each stored as the SHA-256 digest
of the key (`sluice keys new --tenant NAME` prints an entry), with its scope and its tenant, and
the tenants with their weight, queue share, sharing and optional limits:

    tenants:
      acme: {weight: 2, requests_per_minute: 600, tokens_per_minute: 200000, max_streams: 50}
      lab: {share: true}
    keys:
      - {key: "sha256:<64 hex>", scope: admin, tenant: acme}
      - {key: "sha256:<64 hex>", tenant: lab}

The SLUICE_API_KEYS forms stay valid: each such key is a tenant of its own, `key-<first 8 hex
of its digest>`, with the defaults. Callers without a key (no keys configured) are the tenant
`default`. Tenant names are the only label values of the per-tenant metrics, and they appear in
Redis key names: letters, digits, `.`, `_` and `-` only.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

DEFAULT_TENANT = "default"
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


class TenantsError(ValueError):
    """A keys file that cannot be used; the message names the file, the entry and the problem."""


class TenantConfig(BaseModel):
    """One tenant. `weight`: its share of a model's engine against other backlogged tenants;
    `queue_share`: the part of a model's max_queued it may hold while another tenant has work
    queued; `share`: its keys see and cancel each other's requests, files and batches (else each
    key sees only its own). The limits are off when absent."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    weight: float = Field(default=1.0, gt=0, le=1000)
    queue_share: float = Field(default=0.5, gt=0, le=1)
    share: bool = False
    requests_per_minute: int | None = Field(default=None, gt=0)
    tokens_per_minute: int | None = Field(default=None, gt=0)  # prompt + max_tokens at admission
    max_streams: int | None = Field(default=None, gt=0)  # concurrent SSE streams, all api processes
    max_files: int | None = Field(default=None, gt=0)  # files stored
    max_file_bytes: int | None = Field(default=None, gt=0)  # bytes stored, all its files together


DEFAULTS = TenantConfig()


class KeyEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str  # sha256:<64 hex>: the file never holds a key itself
    scope: Literal["user", "admin"] = "user"
    tenant: str

    @field_validator("key")
    @classmethod
    def _digest(cls, key: str) -> str:
        if not _DIGEST.fullmatch(key.lower()):
            raise ValueError("must be sha256:<64 hex digits>, the key's digest (`sluice keys new --tenant "
                             "NAME` prints one), never the key itself")
        return key.lower()

    @property
    def digest(self) -> str:
        return self.key.removeprefix("sha256:")


def _check_name(name: str) -> str:
    if not TENANT_NAME.fullmatch(name):
        raise ValueError(f"tenant name {name!r}: letters, digits, '.', '_' and '-' only, at most 64, "
                         "starting with a letter or digit")
    return name


class KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenants: dict[str, TenantConfig] = Field(default_factory=dict)
    keys: list[KeyEntry] = Field(default_factory=list)

    @field_validator("tenants")
    @classmethod
    def _names(cls, tenants: dict[str, TenantConfig]) -> dict[str, TenantConfig]:
        for name in tenants:
            _check_name(name)
        return tenants

    @model_validator(mode="after")
    def _consistent(self) -> KeysFile:
        seen: set[str] = set()
        for i, entry in enumerate(self.keys):
            if entry.tenant not in self.tenants:
                raise ValueError(f"keys[{i}]: tenant {entry.tenant!r} is not under `tenants:` "
                                 f"(known: {', '.join(sorted(self.tenants)) or 'none'})")
            if entry.digest in seen:
                raise ValueError(f"keys[{i}]: the same key is listed twice")
            seen.add(entry.digest)
        return self


def read_keys_file(path: Path) -> KeysFile:
    """The keys file, or a TenantsError naming the file and what is wrong in it."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as err:
        raise TenantsError(f"SLUICE_KEYS_FILE {path}: cannot be read ({err.strerror or err})") from None
    except yaml.YAMLError as err:
        raise TenantsError(f"SLUICE_KEYS_FILE {path}: not YAML ({err})") from None
    if not isinstance(raw, dict):
        raise TenantsError(f"SLUICE_KEYS_FILE {path}: must be a mapping with `tenants:` and `keys:`")
    try:
        return KeysFile.model_validate(raw)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'file'}: "
                             f"{e['msg'].removeprefix('Value error, ')}" for e in err.errors())
        raise TenantsError(f"SLUICE_KEYS_FILE {path}: {problems}") from None


def key_tenant(digest: str) -> str:
    """The tenant of a SLUICE_API_KEYS key: one of its own, named after its digest."""
    return f"key-{digest[:8]}"


class Tenants:
    """The tenants registry: which tenant each key digest belongs to, and each tenant's
    configuration (the defaults for a name it does not know)."""

    def __init__(self, configs: dict[str, TenantConfig] | None = None, members: dict[str, str] | None = None):
        self.configs = dict(configs or {})
        self.members = dict(members or {})  # digest → tenant
        self._peers: dict[str, frozenset[str]] = {}
        for d, t in self.members.items():
            if self.get(t).share:
                self._peers[t] = self._peers.get(t, frozenset()) | {d}

    def get(self, name: str) -> TenantConfig:
        return self.configs.get(name, DEFAULTS)

    def tenant_of(self, digest: str | None) -> str:
        if digest is None:
            return DEFAULT_TENANT
        return self.members.get(digest) or key_tenant(digest)

    def peers(self, tenant: str) -> frozenset[str]:
        """The digests whose requests, files and batches every key of `tenant` sees (empty when
        it does not share)."""
        return self._peers.get(tenant, frozenset())

    def names(self) -> list[str]:
        """Every tenant name a metric may carry: the configured ones and `default`."""
        return sorted({*self.configs, *self.members.values(), DEFAULT_TENANT})

    def known(self, name: str) -> bool:
        return name in self.configs or name == DEFAULT_TENANT or name in self.members.values()


def build_tenants(api_key_digests: list[str], keys_file: KeysFile | None) -> Tenants:
    """The registry of a keys file and the SLUICE_API_KEYS digests (each its own tenant)."""
    configs = dict(keys_file.tenants) if keys_file else {}
    members = {e.digest: e.tenant for e in keys_file.keys} if keys_file else {}
    for d in api_key_digests:
        if d not in members:
            members[d] = key_tenant(d)
            configs.setdefault(members[d], DEFAULTS)
    return Tenants(configs, members)
