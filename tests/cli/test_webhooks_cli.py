"""`sluice webhooks` (cli/webhooks.py): add (private addresses refused unless allowed; the secret
shown once), list (no secret), test, dead, rm; and the sender as LocalStack (`sluice up`) starts
it: running until SIGTERM, then exiting cleanly."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from typer.testing import CliRunner

from sluice.cli.main import app
from sluice.supervisor.stack import LocalStack


def sluice(redis_url: str, *args: str, **env: str):
    return CliRunner().invoke(app, ["webhooks", *args, "--redis-url", redis_url], env=env, prog_name="sluice")


def test_add_list_test_dead_rm(redis_url: str, redis) -> None:
    refused = sluice(redis_url, "add", "http://127.0.0.1:9/hooks")
    assert refused.exit_code == 2 and "SLUICE_WEBHOOKS_ALLOW_PRIVATE" in refused.output
    assert sluice(redis_url, "add", "https://example.com/", "-e", "request.done").exit_code == 2
    added = sluice(redis_url, "add", "http://127.0.0.1:9/hooks", "-e", "request.completed",
                   SLUICE_WEBHOOKS_ALLOW_PRIVATE="1")
    assert added.exit_code == 0, added.output
    endpoint = json.loads(added.stdout)
    assert endpoint["secret"].startswith("whsec_") and endpoint["events"] == ["request.completed"]
    (listed,) = json.loads(sluice(redis_url, "list").stdout)
    assert listed["id"] == endpoint["id"] and "secret" not in listed
    assert json.loads(sluice(redis_url, "test", endpoint["id"]).stdout)["queued"] is True
    assert json.loads(sluice(redis_url, "dead").stdout) == []
    assert json.loads(sluice(redis_url, "rotate", endpoint["id"]).stdout)["secret"] != endpoint["secret"]
    assert json.loads(sluice(redis_url, "disable", endpoint["id"]).stdout)["enabled"] is False
    assert json.loads(sluice(redis_url, "rm", endpoint["id"]).stdout)["deleted"] is True
    assert sluice(redis_url, "rm", endpoint["id"]).exit_code == 1


def test_the_stack_starts_a_sender_that_stops_on_sigterm(redis_url: str, tmp_path: Path) -> None:
    stack = LocalStack(tmp_path, redis_url=redis_url, output="logs")
    sender = stack.start_webhooks()
    log = tmp_path / "logs" / "webhooks.log"
    try:
        deadline = time.monotonic() + 90
        while "running" not in (log.read_text() if log.exists() else ""):
            assert sender.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        assert sender in stack.processes
    finally:
        sender.send_signal(signal.SIGTERM)
        assert sender.wait(30) == 0, log.read_text()
