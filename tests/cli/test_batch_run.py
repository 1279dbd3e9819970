"""`sluice batch run` against a scripted api: it exits non-zero when rows failed and prints the
first errors, and its progress fits an 80-column terminal (issue 30, defect 4)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from sluice.cli import batch as batch_cli
from sluice.cli.main import app


def scripted_api(total: int, failed: int, polls: int) -> httpx.MockTransport:
    """An api whose batch runs `polls` polls, then ends with `failed` of `total` rows failed."""
    batch_id = f"batch_{uuid.uuid4().hex}"
    seen = {"polls": 0}

    def batch(status: str, done: int, bad: int) -> dict:
        final = status == "completed"
        return {"id": batch_id, "status": status, "usage": {"output_tokens": 7 * done},
                "request_counts": {"total": total, "completed": done, "failed": bad},
                "output_file_id": "file-out" if final and done else None,
                "error_file_id": "file-err" if final and bad else None}

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/files" and request.method == "POST":
            return httpx.Response(200, json={"id": "file-in"})
        if path == "/v1/batches":
            return httpx.Response(200, json=batch("validating", 0, 0))
        if path == f"/v1/batches/{batch_id}":
            seen["polls"] += 1
            if seen["polls"] < polls:
                return httpx.Response(200, json=batch("in_progress", 0, 0))
            return httpx.Response(200, json=batch("completed", total - failed, failed))
        if path == "/v1/files/file-err/content":
            return httpx.Response(200, text="".join(
                json.dumps({"custom_id": str(i), "response": None,
                            "error": {"code": "invalid_request", "message": f"row {i}: no model 'nope'"}}) + "\n"
                for i in range(failed)))
        if path == "/v1/files/file-out/content":
            return httpx.Response(200, text="".join(
                json.dumps({"custom_id": str(i), "response": {"status_code": 200, "body": {}}, "error": None}) + "\n"
                for i in range(failed, total)))
        return httpx.Response(404, json={"error": {"message": f"no route {path}"}})

    return httpx.MockTransport(handler)


@pytest.fixture
def input_file(tmp_path: Path) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"custom_id": str(i), "method": "POST", "url": "/v1/completions",
                                        "body": {"model": "nope", "prompt": "x"}}) + "\n" for i in range(6)))
    return path


def run(monkeypatch: pytest.MonkeyPatch, input_file: Path, transport: httpx.MockTransport) -> object:
    monkeypatch.setattr(batch_cli, "_client",
                        lambda url, key: httpx.Client(base_url="http://sluice", transport=transport))
    monkeypatch.setattr(batch_cli.time, "sleep", lambda _s: None)
    monkeypatch.setenv("COLUMNS", "80")
    return CliRunner().invoke(app, ["batch", "run", str(input_file), "-o", str(input_file.with_name("out.jsonl")),
                                    "--model", "nope"])


@pytest.mark.parametrize("failed", [6, 1])
def test_failed_rows_exit_non_zero_with_the_first_errors(monkeypatch: pytest.MonkeyPatch, input_file: Path,
                                                          failed: int) -> None:
    result = run(monkeypatch, input_file, scripted_api(6, failed, polls=3))
    assert result.exit_code == 1, result.output
    assert f"{6 - failed} done, {failed} failed of 6" in result.output
    assert "row 0: no model 'nope'" in result.stderr
    assert sum("no model 'nope'" in x for x in result.stderr.splitlines()) == min(failed, 3)  # the first few


def test_all_rows_done_exits_zero(monkeypatch: pytest.MonkeyPatch, input_file: Path) -> None:
    result = run(monkeypatch, input_file, scripted_api(6, 0, polls=2))
    assert result.exit_code == 0, result.output
    assert "6 done, 0 failed of 6" in result.output


def test_the_progress_fits_80_columns_with_its_row_count(monkeypatch: pytest.MonkeyPatch, input_file: Path) -> None:
    result = run(monkeypatch, input_file, scripted_api(100_000, 0, polls=2))
    lines = [x for x in result.output.splitlines() if " -> " not in x]  # the summary names the output file
    assert all(len(x) <= 80 for x in lines), lines
    assert any("100000/100000" in x for x in lines), lines  # not "0…"


def test_a_rate_takes_at_most_six_characters() -> None:
    """The progress line's rates stay narrow however fast the first poll finds rows done (a
    195-million rows/s figure once pushed the row count out of 80 columns)."""
    from sluice.cli.batch import _per_second

    for rate in (0, 0.05, 999.94, 1e3, 99_999, 1e6 - 1, 195_211_844.1, 1_366_482_908, 9.9e10):
        assert len(_per_second(rate)) <= 6, (rate, _per_second(rate))
