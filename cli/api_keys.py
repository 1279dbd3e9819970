"""`sluice keys new`: a fresh API key, and the SLUICE_API_KEYS entry that holds only its digest."""

from __future__ import annotations

import secrets
from enum import Enum

import typer

from sluice.api.auth import digest

keys_app = typer.Typer(no_args_is_help=True, help="API keys: make one for SLUICE_API_KEYS.")


class KeyScope(str, Enum):
    user = "user"
    admin = "admin"


def new_key() -> str:
    # 256 random bits, URL-safe: never a comma (it separates SLUICE_API_KEYS entries) or a colon.
    return "sk-sluice-" + secrets.token_urlsafe(32)


@keys_app.command("new")
def keys_new(
    scope: KeyScope = typer.Option(KeyScope.user, "--scope", help="user: submits, and sees and cancels its own "
                                   "requests, files and batches; admin: everything."),
) -> None:
    """Print a new key and its SLUICE_API_KEYS entry.

    Give the key to its holder, and put the entry in the api's environment (comma-separated with
    the others): the api keeps only the key's digest."""
    key = new_key()
    typer.echo(f"key={key}")
    typer.echo(f"SLUICE_API_KEYS={scope.value}:sha256:{digest(key)}")
    typer.echo("The key is shown once and stored nowhere; the SLUICE_API_KEYS entry holds only its "
               "SHA-256 digest.", err=True)
