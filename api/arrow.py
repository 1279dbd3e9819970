"""Rows in and out of the infer route: JSON records or Arrow IPC streams, checked against a schema."""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from sluice.api.errors import ApiError

ARROW_STREAM = "application/vnd.apache.arrow.stream"
MAX_ROWS = 10_000


def wants_arrow(content_type: str | None) -> bool:
    return (content_type or "").split(";")[0].strip().lower() == ARROW_STREAM


def _check_columns(present: list[str], schema: pa.Schema, where: str) -> None:
    unknown = [n for n in present if n not in schema.names]
    if unknown:
        raise ApiError(400, f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; "
                            f"the input schema has {', '.join(schema.names)}", param=unknown[0])


def _check_values(table: pa.Table, schema: pa.Schema) -> list[dict[str, Any]]:
    if table.num_rows == 0:
        raise ApiError(400, "rows: at least one row is needed", param="rows")
    if table.num_rows > MAX_ROWS:
        raise ApiError(413, f"rows: at most {MAX_ROWS} rows per request", param="rows")
    rows = table.to_pylist()
    for f in schema:
        if f.nullable:
            continue
        for i, row in enumerate(rows):
            if row.get(f.name) is None:
                raise ApiError(400, f"rows[{i}].{f.name}: field required", param=f.name)
    for i, row in enumerate(rows):
        prompt = row.get("prompt")
        if prompt is not None and not prompt.strip():
            raise ApiError(400, f"rows[{i}].prompt: must not be empty", param="prompt")
        max_tokens = row.get("max_tokens")
        if max_tokens is not None and max_tokens < 1:
            raise ApiError(400, f"rows[{i}].max_tokens: must be at least 1", param="max_tokens")
    return rows


def parse_rows(body: bytes, content_type: str | None, schema: pa.Schema) -> list[dict[str, Any]]:
    """Rows as dicts, checked against `schema`; a 4xx ApiError naming the problem otherwise."""
    if wants_arrow(content_type):
        try:
            table = pa.ipc.open_stream(pa.py_buffer(body)).read_all()
        except (pa.ArrowInvalid, pa.ArrowException, OSError) as err:
            raise ApiError(400, f"body: not a valid Arrow IPC stream ({err})") from None
        _check_columns(table.column_names, schema, "body")
        missing = [f for f in schema if f.name not in table.column_names]
        for f in missing:
            if not f.nullable:
                raise ApiError(400, f"body: column {f.name!r} is required", param=f.name)
            table = table.append_column(f.name, pa.nulls(table.num_rows, f.type))
        try:
            table = table.select(schema.names).cast(schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as err:
            raise ApiError(400, f"body: columns do not match the input schema ({err})") from None
        return _check_values(table, schema)
    ctype = (content_type or "").split(";")[0].strip().lower()
    if ctype not in ("application/json", ""):
        raise ApiError(415, f"content type {ctype!r} is not accepted: send application/json "
                            f"records or an {ARROW_STREAM}")
    try:
        records = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(400, f"body: invalid JSON ({err})") from None
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise ApiError(400, "body: expected a JSON list of records, e.g. [{\"prompt\": \"...\"}]")
    for i, r in enumerate(records):
        _check_columns(list(r), schema, f"rows[{i}]")
    try:
        table = pa.Table.from_pylist(records, schema=schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
        raise ApiError(400, f"rows: values do not match the input schema ({err})") from None
    return _check_values(table, schema)


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def encode_rows(rows: list[dict[str, Any]], schema: pa.Schema) -> bytes:
    return _ipc(pa.Table.from_pylist([{n: r.get(n) for n in schema.names} for r in rows], schema=schema))


def encode_table(rows: list[dict[str, Any]]) -> bytes:
    """Rows of any shape (nested values as JSON strings) as an Arrow IPC stream."""
    return _ipc(pa.Table.from_pylist(
        [{k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in r.items()} for r in rows]
    ))
