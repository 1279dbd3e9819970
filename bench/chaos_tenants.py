"""Tenants in `sluice bench chaos`: the keys file the stack runs with, the clients' keys, and
the per-tenant figures of the audit.

With `--tenants N` (N >= 2) the stack gets a keys file (SLUICE_KEYS_FILE, config/tenants.py):
tenants t0..t{N-1}, one user key each, weights 1, 2, 1, 1, 2, 1, ... (fair share, on by default,
has backlogs of unequal weights to order), and an admin key of a tenant `ops` that sends no load
and only creates the receiver's webhook endpoints, one per tenant key (owner: that key's digest).
Client c sends every call as tenant c % N. The audit checks that each accepted request's status
names its client's tenant, and counts accepted and done per tenant."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from sluice.api.auth import digest

ADMIN_TENANT = "ops"


@dataclass
class Tenancy:
    """The tenants of a run, in order (client c is `names[c % len(names)]`), each one's key, and
    the admin key; no tenants (`names` empty): no keys file, every caller is `default`."""

    names: list[str] = field(default_factory=list)
    keys: dict[str, str] = field(default_factory=dict)  # tenant -> key
    admin_key: str = ""

    @classmethod
    def of(cls, n: int) -> Tenancy:
        names = [f"t{i}" for i in range(n)] if n >= 2 else []
        return cls(names, {t: f"sk-chaos-{t}-{secrets.token_hex(12)}" for t in names},
                   f"sk-chaos-{ADMIN_TENANT}-{secrets.token_hex(12)}" if names else "")

    def weight(self, tenant: str) -> int:
        return 2 if self.names.index(tenant) % 3 == 1 else 1

    def of_client(self, c: int) -> str:
        """The tenant client `c` sends as ('default' without tenants: the anonymous caller's)."""
        return self.names[c % len(self.names)] if self.names else "default"

    def headers(self, tenant: str) -> dict[str, str]:
        key = self.keys.get(tenant)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else {}

    def owner(self, tenant: str) -> str:
        """The owner a request of `tenant` is stored under: its key's digest ('' without keys)."""
        key = self.keys.get(tenant)
        return digest(key) if key else ""

    def write(self, path: Path) -> Path | None:
        """The keys file (JSON is YAML) at `path`; None (and no file) without tenants."""
        if not self.names:
            return None
        path.write_text(json.dumps({
            "tenants": {**{t: {"weight": self.weight(t)} for t in self.names}, ADMIN_TENANT: {}},
            "keys": [*({"key": f"sha256:{digest(k)}", "tenant": t} for t, k in self.keys.items()),
                     {"key": f"sha256:{digest(self.admin_key)}", "scope": "admin", "tenant": ADMIN_TENANT}]}))
        return path


def per_tenant(rows: list[dict]) -> dict[str, dict[str, int]]:
    """Per client tenant, from the audit's rows: accepted, done (its final says so), failed as
    diverged (a retried structured row, as designed) and stored under another tenant."""
    out: dict[str, dict[str, int]] = {}
    for row in rows:
        f = out.setdefault(row["tenant"], {"accepted": 0, "done": 0, "diverged": 0, "mismatch": 0})
        f["accepted"] += 1
        f["done"] += bool(row["finals"]) and row["finals"][0].startswith("done@")
        f["diverged"] += bool(row["diverged"])
        f["mismatch"] += any(b.startswith("tenant") for b in row["broken"])
    return dict(sorted(out.items()))


def tenant_row(by_tenant: dict[str, dict[str, int]]) -> tuple[str, str]:
    """The chaos table's line: accepted / done per tenant."""
    return ("accepted / done per tenant",
            ", ".join(f"{t} {f['accepted']}/{f['done']}" for t, f in by_tenant.items()))
