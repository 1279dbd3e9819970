"""`sluice keys new`: a fresh API key, and the entries that hold only its digest: one for the
keys file (SLUICE_KEYS_FILE, with its tenant) and one for SLUICE_API_KEYS."""

from __future__ import annotations

import secrets
from enum import Enum

import typer

from sluice.api.auth import digest
from sluice.config.tenants import TENANT_NAME

keys_app = typer.Typer(no_args_is_help=True, help="API keys: make one for the keys file or SLUICE_API_KEYS.")


class KeyScope(str, Enum):
    user = "user"
    admin = "admin"


def new_key() -> str:
    # 256 random bits, URL-safe: never a comma (it separates SLUICE_API_KEYS entries) or a colon.
    return "sk-sluice-" + secrets.token_urlsafe(32)


def _tenant(name: str | None) -> str | None:
    if name is not None and not TENANT_NAME.fullmatch(name):
        raise typer.BadParameter("letters, digits, '.', '_' and '-' only, at most 64, "
                                 "starting with a letter or digit")
    return name


@keys_app.command("new")
def keys_new(
    scope: KeyScope = typer.Option(KeyScope.user, "--scope",
                                   help="user: submits, and sees and cancels its own requests, files "
                                        "and batches; admin: everything."),
    tenant: str | None = typer.Option(None, "--tenant", metavar="NAME", callback=_tenant,
                                      help="The key's tenant: prints its entry for the keys file "
                                           "(SLUICE_KEYS_FILE)."),
) -> None:
    """Print a new key, its keys-file entry (with --tenant) and its SLUICE_API_KEYS entry.

    Give the key to its holder, and put one entry where the api reads keys: under `keys:` in the
    keys file (its tenant under `tenants:`), or in SLUICE_API_KEYS (comma-separated with the
    others; such a key is a tenant of its own). The api keeps only the key's digest."""
    key = new_key()
    typer.echo(f"key={key}")
    if tenant is not None:
        typer.echo(f"# for the keys file (SLUICE_KEYS_FILE), under `keys:` "
                   f"(tenant {tenant} under `tenants:`)")
        typer.echo(f'- {{key: "sha256:{digest(key)}", scope: {scope.value}, tenant: {tenant}}}')
    typer.echo(f"SLUICE_API_KEYS={scope.value}:sha256:{digest(key)}")
    typer.echo("The key is shown once and stored nowhere; each entry holds only its SHA-256 digest.",
               err=True)
