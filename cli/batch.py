"""`sluice batch`: run a file of prompts as a bulk job through the api, with live progress.

Input: an OpenAI batch JSONL file, or a Parquet / Arrow file with a `prompt` column (and
optionally `custom_id`, `max_tokens`, `temperature`, `top_p`, `seed`). The output has the
input's format: the batch output JSONL, or a table with one row per input row, in order.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from sluice.cli.shared import ApiKey, ApiUrl
from sluice.protocol.states import FINAL_BATCH_STATES

batch_app = typer.Typer(no_args_is_help=True, help="Bulk jobs: run a file through a model, watch, cancel.")

BatchId = typer.Argument(..., metavar="BATCH_ID", help="The batch job's id (batch_...).")
PARAMS = ("max_tokens", "temperature", "top_p", "seed")
SHOWN_ERRORS = 3  # failed rows printed when a batch ends; the rest are in the output file


def _format(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    if suffix in (".arrow", ".feather", ".ipc", ".arrows"):
        return "arrow"
    raise typer.BadParameter(f"{path}: use .jsonl, .parquet or .arrow")


def _read_table(path: Path, fmt: str) -> pa.Table:
    if fmt == "parquet":
        return pq.read_table(path)
    try:
        return pa.ipc.open_file(path).read_all()
    except pa.ArrowInvalid:
        return pa.ipc.open_stream(path.read_bytes()).read_all()


def _lines_from_table(table: pa.Table, model: str, endpoint: str, max_tokens: int) -> bytes:
    if "prompt" not in table.column_names:
        raise typer.BadParameter(
            f"the input has no 'prompt' column (columns: {', '.join(table.column_names)})")
    out = []
    for i, row in enumerate(table.to_pylist()):
        body: dict[str, Any] = {"model": model, "max_tokens": row.get("max_tokens") or max_tokens}
        body.update({k: row[k] for k in PARAMS[1:] if row.get(k) is not None})
        if endpoint == "/v1/chat/completions":
            body["messages"] = [{"role": "user", "content": row["prompt"]}]
        else:
            body["prompt"] = row["prompt"]
        custom_id = str(row.get("custom_id") if row.get("custom_id") is not None else i)
        out.append(json.dumps({"custom_id": custom_id, "method": "POST", "url": endpoint, "body": body}))
    return "\n".join(out).encode()


def _write_table(path: Path, fmt: str, table: pa.Table) -> None:
    if fmt == "parquet":
        pq.write_table(table, path)
    else:
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)


def _results_table(input_lines: list[dict], records: list[dict]) -> pa.Table:
    by_id = {r["custom_id"]: r for r in records if r.get("custom_id") is not None}
    rows = []
    for line in input_lines:
        r = by_id.get(line["custom_id"], {})
        body = (r.get("response") or {}).get("body") or {}
        choice = (body.get("choices") or [{}])[0]
        text = choice.get("text", (choice.get("message") or {}).get("content"))
        rows.append({"custom_id": line["custom_id"], "generated_text": text,
                     "num_output_tokens": (body.get("usage") or {}).get("completion_tokens"),
                     "finish_reason": choice.get("finish_reason"),
                     "error": (r.get("error") or {}).get("message") if r else "not run"})
    return pa.Table.from_pylist(rows, schema=pa.schema([
        ("custom_id", pa.string()), ("generated_text", pa.string()), ("num_output_tokens", pa.int64()),
        ("finish_reason", pa.string()), ("error", pa.string())]))


def _client(url: str, api_key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=120)


def _check(r: httpx.Response) -> dict:
    if r.status_code >= 400:
        is_json = r.headers.get("content-type", "").startswith("application/json")
        message = r.json().get("error", {}).get("message", r.text) if is_json else r.text
        typer.echo(f"error ({r.status_code}): {message}", err=True)
        raise typer.Exit(1)
    return r.json()


@batch_app.command("run")
def run(
    input: Path = typer.Argument(..., exists=True, dir_okay=False, metavar="INPUT",
                                 help=".jsonl (OpenAI batch lines), or .parquet / .arrow with a prompt "
                                      "column (and optionally custom_id, max_tokens, temperature, "
                                      "top_p, seed)."),
    output: Path = typer.Option(..., "-o", "--output", metavar="OUTPUT",
                                help="Where to write the results (same format)."),
    model: str = typer.Option(..., "--model", metavar="MODEL", help="The deployed model."),
    endpoint: str = typer.Option("/v1/completions", "--endpoint", metavar="PATH",
                                 help="/v1/completions or /v1/chat/completions, for table input "
                                      "(a .jsonl line names its own url)."),
    max_tokens: int = typer.Option(256, "--max-tokens", metavar="N",
                                   help="For rows that do not set their own."),
    url: str = ApiUrl,
    api_key: str | None = ApiKey,
) -> None:
    """Run a file of prompts as a batch job, and write its results.

    Submits INPUT as a batch job, shows its progress, and writes OUTPUT when it ends."""
    fmt = _format(input)
    if fmt == "jsonl":
        data = input.read_bytes()
    else:
        data = _lines_from_table(_read_table(input, fmt), model, endpoint, max_tokens)
    input_lines = [json.loads(x) for x in data.decode().splitlines() if x.strip()] if fmt != "jsonl" else []
    if fmt == "jsonl":
        endpoint = json.loads(data.decode().splitlines()[0]).get("url", endpoint)
    with _client(url, api_key) as client:
        f = _check(client.post("/v1/files", files={"file": (input.name, data)}, data={"purpose": "batch"}))
        batch = _check(client.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": endpoint,
                                                         "completion_window": "24h"}))
        batch = _follow(client, batch)
        records: list[dict] = []
        for key in ("output_file_id", "error_file_id"):
            if batch.get(key):
                content = client.get(f"/v1/files/{batch[key]}/content").content.decode()
                records += [json.loads(x) for x in content.splitlines() if x.strip()]
    if fmt == "jsonl":
        output.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        _write_table(output, fmt, _results_table(input_lines, records))
    counts = batch["request_counts"]
    typer.echo(f"{batch['id']} {batch['status']}: {counts['completed']} done, {counts['failed']} failed "
               f"of {counts['total']} -> {output}")
    errors = [r for r in records if r.get("error")]
    for r in errors[:SHOWN_ERRORS]:
        typer.echo(f"  {r.get('custom_id')}: {(r['error'] or {}).get('message', r['error'])}", err=True)
    if len(errors) > SHOWN_ERRORS:
        typer.echo(f"  ... {len(errors) - SHOWN_ERRORS} more in {output}", err=True)
    if batch["status"] != "completed" or counts["failed"]:
        raise typer.Exit(1)


def _follow(client: httpx.Client, batch: dict) -> dict:
    """Poll the batch with a progress bar (rows, rows/s, tokens/s, ETA); Ctrl-C cancels it."""
    started = time.monotonic()
    # Fits 80 columns: the batch id is said once above it, not on every refresh.
    columns = [TextColumn("[bold]{task.description:<11}"), BarColumn(bar_width=16), MofNCompleteColumn(),
               TextColumn("{task.fields[rate]}"), TimeRemainingColumn(compact=True)]
    typer.echo(f"{batch['id']}: {batch['status']}", err=True)
    try:
        with Progress(*columns, transient=False) as progress:
            task = progress.add_task(batch["status"], total=None, rate="")
            while batch["status"] not in FINAL_BATCH_STATES:
                time.sleep(0.5)
                batch = _check(client.get(f"/v1/batches/{batch['id']}"))
                c = batch["request_counts"]
                done = c["completed"] + c["failed"]
                elapsed = max(time.monotonic() - started, 1e-6)
                rate = (f"{_per_second(done / elapsed)} rows/s "
                        f"{_per_second(batch['usage']['output_tokens'] / elapsed)} tok/s")
                progress.update(task, total=c["total"] or None, completed=done, rate=rate,
                                description=batch["status"])
    except KeyboardInterrupt:
        typer.echo(f"cancelling {batch['id']}", err=True)
        _check(client.post(f"/v1/batches/{batch['id']}/cancel"))
        while batch["status"] not in FINAL_BATCH_STATES:
            time.sleep(0.5)
            batch = _check(client.get(f"/v1/batches/{batch['id']}"))
    return batch


@batch_app.command("status")
def status(batch_id: str = BatchId, url: str = ApiUrl, api_key: str | None = ApiKey) -> None:
    """Show a batch job."""
    with _client(url, api_key) as client:
        typer.echo(json.dumps(_check(client.get(f"/v1/batches/{batch_id}")), indent=2))


@batch_app.command("cancel")
def cancel(batch_id: str = BatchId, url: str = ApiUrl, api_key: str | None = ApiKey) -> None:
    """Cancel a batch job.

    Its outstanding rows are aborted, its finished ones are kept."""
    with _client(url, api_key) as client:
        typer.echo(_check(client.post(f"/v1/batches/{batch_id}/cancel"))["status"])


def _per_second(rate: float) -> str:
    """A rate in at most 6 characters (k, M, G), so that the progress line keeps its row count
    within 80 columns however fast the first poll finds rows done."""
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if rate >= scale:
            return f"{rate / scale:.1f}{unit}" if rate < 100 * scale else f"{rate / scale:.0f}{unit}"
    return f"{rate:.1f}"
