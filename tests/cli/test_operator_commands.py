"""Operator commands that talk to Redis (`sluice dlq`) find the running `sluice up`'s Redis by
default (recorded in its data directory), say which Redis they used, refuse a model that is not
deployed, and answer an unreachable Redis with one line, not a traceback (issue 30, defect 2)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from redis.asyncio import Redis
from typer.testing import CliRunner

from sluice.broker.registry import ModelRegistry
from sluice.cli.main import app
from sluice.cli.running import DataDirBusy, UpLock, running_redis_url
from sluice.config.model import ModelConfig
from sluice.supervisor.processes import free_port


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("SLUICE_REDIS_URL", raising=False)
    monkeypatch.setenv("SLUICE_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"


def deployed(redis_url: str) -> str:
    """A model deployed on the Redis (the CLI runs its own event loop: this test has none)."""
    name = f"m-{uuid.uuid4().hex[:8]}"

    async def deploy() -> None:
        async with Redis.from_url(redis_url, decode_responses=True) as redis:
            await ModelRegistry(redis).deploy(ModelConfig(name=name))

    asyncio.run(deploy())
    return name


@pytest.mark.parametrize("command", [["list"], ["retry", "--all"], ["drop", "--all"]])
def test_dlq_uses_the_redis_of_the_sluice_up_running_on_the_data_dir(
        redis_url: str, env: Path, command: list[str]) -> None:
    model = deployed(redis_url)
    lock = UpLock(env).acquire()
    lock.record_redis(redis_url)
    try:
        result = CliRunner().invoke(app, ["dlq", *command, "--model", model])
    finally:
        lock.release()
    assert result.exit_code == 0, result.output
    assert f"Redis: {redis_url} (the sluice up running on {env})" in result.stderr


@pytest.mark.parametrize("command", [["list"], ["retry", "--all"], ["drop", "--all"]])
def test_an_unknown_model_is_an_error_naming_the_deployed_ones(
        redis_url: str, env: Path, command: list[str]) -> None:
    model = deployed(redis_url)
    result = CliRunner().invoke(app, ["dlq", *command, "--model", "no-such-model", "--redis-url", redis_url])
    assert result.exit_code == 2, result.output
    assert "no model 'no-such-model' is deployed" in result.stderr and model in result.stderr
    assert "no dead letters" not in result.output
    assert f"Redis: {redis_url} (--redis-url or SLUICE_REDIS_URL)" in result.stderr


@pytest.mark.parametrize("command", [["list"], ["retry", "--all"], ["drop", "x1"]])
@pytest.mark.parametrize("how", ["option", "recorded"])
def test_an_unreachable_redis_is_one_line_not_a_traceback(env: Path, command: list[str], how: str) -> None:
    nobody = f"redis://127.0.0.1:{free_port()}/0"
    lock = UpLock(env).acquire()
    lock.record_redis(nobody)
    try:
        args = ["--redis-url", nobody] if how == "option" else []
        result = CliRunner().invoke(app, ["dlq", *command, "--model", "m", *args])
    finally:
        lock.release()
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    errors = [x for x in result.stderr.splitlines() if not x.startswith("Redis: ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: no Redis answers at {nobody}"), result.stderr
    assert "Traceback" not in result.output


def test_the_record_is_believed_only_while_its_sluice_up_holds_the_data_dir(tmp_path: Path) -> None:
    lock = UpLock(tmp_path).acquire()
    lock.record_redis("redis://127.0.0.1:6390/0")
    assert running_redis_url(tmp_path) == "redis://127.0.0.1:6390/0"
    with pytest.raises(DataDirBusy, match="another sluice up"):
        UpLock(tmp_path).acquire()
    lock.release()
    assert running_redis_url(tmp_path) is None
    (tmp_path / "redis-url").write_text("redis://127.0.0.1:6390/0\n")  # left by a sluice up killed -9
    assert running_redis_url(tmp_path) is None
    UpLock(tmp_path).acquire().release()  # free again
