"""`sluice bench hostile` runs against a stack it starts, and prints a row per attack."""

from __future__ import annotations

from typer.testing import CliRunner

from sluice.cli.main import app as cli


def test_bench_hostile_replays_the_chosen_attacks() -> None:
    done = CliRunner().invoke(cli, ["bench", "hostile", "--only", "trailing", "--only", "top_k",
                                    "--only", "20,000 prompts", "--only", "without a key"])
    assert done.exit_code == 0, done.output
    rows = {line.split("  ")[0]: line for line in done.output.splitlines()}
    assert " 404 location=None" in rows["trailing slash, Host: evil.example"], done.output
    assert " 400 invalid_request_error" in rows["top_k 10^30"], done.output
    assert " 413 request_too_large" in rows["completions 20,000 prompts x n=16"], done.output
    assert "401 Unauthorized from its headers" in rows["upload 150 MB without a key"], done.output
    assert " 0 B spooled" in rows["upload 150 MB without a key"], done.output
    assert "error:" not in done.output


def test_bench_hostile_sends_a_batch_file_over_the_line_cap_and_shows_the_jobs_worker() -> None:
    done = CliRunner().invoke(cli, ["bench", "hostile", "--only", "batch input file", "--batch-lines", "60",
                                    "--max-batch-lines", "50"])
    assert done.exit_code == 0, done.output
    rows = {line.split("  ")[0]: line for line in done.output.splitlines()}
    row = rows["batch input file of 60 lines"]
    assert "upload 200" in row and "create 400" in row and "SLUICE_MAX_BATCH_LINES" in row, done.output
    assert "jobs worker idle RSS" in done.output and " jobs " in row, done.output
    assert "error:" not in done.output
