"""The options of a `sluice` command as a deployment file writes it, for the deployment tests
(tests/test_deploy.py, tests/deploy_k8s): `["worker", "--model", ...]`, `["webhooks", "send", ...]`."""

from __future__ import annotations

import typer

from sluice.cli.main import app


def cli_options(command: list[str]) -> set[str]:
    """The options of the (sub)command `command` names: its words up to the first option, through
    the command groups (`webhooks send`). A word that names no command fails with a KeyError."""
    sub = typer.main.get_command(app)
    for word in command:
        if word.startswith("-") or not hasattr(sub, "commands"):
            break
        sub = sub.commands[word]  # type: ignore[attr-defined]
    return {opt for p in sub.params for opt in p.opts}
