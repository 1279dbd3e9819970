"""`sluice up` has one configuration path: every flag has its `SLUICE_*` variable, shown in
`--help`, and the variables reach run_up (issue 30, defect 3: SLUICE_API_PORT and SLUICE_API_HOST
were ignored)."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from sluice.cli import up as up_module
from sluice.cli.main import app


def up_options() -> list:
    command = typer.main.get_command(app).commands["up"]  # type: ignore[attr-defined]
    return [p for p in command.params if p.name != "help"]


def test_every_up_flag_has_a_sluice_variable_shown_in_help(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    shown = " ".join(CliRunner().invoke(app, ["up", "--help"]).output.split())  # as wrapped to the terminal
    for option in up_options():
        assert isinstance(option.envvar, str) and option.envvar.startswith("SLUICE_"), option.name
        assert f"env var: {option.envvar}" in shown, option.envvar


@pytest.mark.parametrize(("env", "expected"), [
    ({"SLUICE_API_PORT": "18123"}, ("127.0.0.1", 18123, None)),
    ({"SLUICE_API_HOST": "::1", "SLUICE_API_PORT": "0"}, ("::1", 0, None)),
    ({"SLUICE_REDIS_URL": "redis://127.0.0.1:1/0"}, ("127.0.0.1", 8000, "redis://127.0.0.1:1/0")),
])
def test_the_variables_reach_sluice_up(monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                                       expected: tuple) -> None:
    for name in ("SLUICE_API_PORT", "SLUICE_API_HOST", "SLUICE_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    seen = []
    monkeypatch.setattr(up_module, "run_up", lambda redis_url, host, port, *_a, **_k: seen.append(
        (host, port, redis_url)) or 0)
    result = CliRunner().invoke(app, ["up"])
    assert result.exit_code == 0, result.output
    assert seen == [expected]
