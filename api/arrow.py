"""Rows in and out of the infer route: JSON records or Arrow IPC streams, checked against a schema.

Every value is checked before it is converted: the wrong kind of value (a string for a
number) is a 400, a number or text of the right kind that the field cannot hold (1.5 or
10**23 for an int64, a lone surrogate in a string) is a 422, and nothing reaches a 500.

An Arrow body is read one IPC message at a time. The row count, the number of columns and the
decoded size of each record batch are taken from its metadata and checked before the batch is
decoded: a compressed buffer starts with its uncompressed length, so a few KB of ZSTD that
would decode to gigabytes is refused having allocated nothing.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from sluice.api.errors import ApiError
from sluice.api.schemas import require_unicode
from sluice.config.settings import Settings
from sluice.protocol.messages import MAX_TOKENS

ARROW_STREAM = "application/vnd.apache.arrow.stream"
_SCHEMA, _RECORD_BATCH = 1, 3  # MessageHeader union tags (Arrow's Message.fbs)


_DEFAULT = Settings.model_fields


@dataclass(frozen=True)
class RowLimits:
    max_rows: int = _DEFAULT["max_rows_per_request"].default
    max_columns: int = _DEFAULT["max_arrow_columns"].default
    max_decoded_bytes: int = _DEFAULT["max_decoded_bytes"].default

    @classmethod
    def of(cls, settings: Settings) -> RowLimits:
        return cls(settings.max_rows_per_request, settings.max_arrow_columns, settings.max_decoded_bytes)


def wants_arrow(content_type: str | None) -> bool:
    return (content_type or "").split(";")[0].strip().lower() == ARROW_STREAM


class _Flat:
    """One table of a flatbuffer: just enough of the format to read IPC message metadata
    without pyarrow decoding the message body. Offsets are bounds-checked (unpack_from would
    read negative ones from the end of the buffer)."""

    def __init__(self, buf: pa.Buffer, pos: int) -> None:
        self.buf, self.pos = buf, pos
        self.vtable = pos - self._get("<i", pos)
        self.vtable_size = self._get("<H", self.vtable)

    @classmethod
    def root(cls, buf: pa.Buffer) -> _Flat:
        return cls(buf, struct.unpack_from("<I", buf, 0)[0])

    def _get(self, fmt: str, at: int) -> int:
        if at < 0 or at + struct.calcsize(fmt) > self.buf.size:
            raise ValueError("IPC metadata: offset out of bounds")
        return struct.unpack_from(fmt, self.buf, at)[0]

    def field(self, index: int) -> int | None:
        entry = 4 + 2 * index
        offset = self._get("<H", self.vtable + entry) if entry < self.vtable_size else 0
        return self.pos + offset if offset else None

    def scalar(self, index: int, fmt: str) -> int:
        return 0 if (at := self.field(index)) is None else self._get(fmt, at)

    def table(self, index: int) -> _Flat:
        if (at := self.field(index)) is None:
            raise ValueError("IPC metadata: a required table is missing")
        return _Flat(self.buf, at + self._get("<I", at))

    def vector(self, index: int, item_size: int) -> tuple[int, int]:
        """Where the vector's items start, and how many there are."""
        if (at := self.field(index)) is None:
            return 0, 0
        start = at + self._get("<I", at)
        count = self._get("<I", start)
        if start + 4 + count * item_size > self.buf.size:
            raise ValueError("IPC metadata: vector out of bounds")
        return start + 4, count

    def structs(self, index: int, fmt: str) -> list[tuple[int, ...]]:
        start, count = self.vector(index, struct.calcsize(fmt))
        return [struct.unpack_from(fmt, self.buf, start + i * struct.calcsize(fmt)) for i in range(count)]


def _header(message: pa.ipc.Message, kind: int) -> _Flat:
    meta = _Flat.root(message.metadata)
    if meta.scalar(1, "<B") != kind:
        raise ApiError(400, "body: Arrow IPC stream: only a schema and record batches are accepted "
                            "(no dictionaries)")
    return meta.table(2)


def _decoded_size(batch: _Flat, body: pa.Buffer | None) -> int:
    """Bytes the batch's buffers take once decoded; for a compressed batch, from the uncompressed
    length (int64, -1 when the buffer was left uncompressed) that starts every buffer."""
    buffers = batch.structs(2, "<qq")  # Buffer {offset, length}
    if batch.field(3) is None:  # no BodyCompression: the buffers are slices of the body
        return sum(max(length, 0) for _, length in buffers)
    size = 0
    for offset, length in buffers:
        if length == 0:
            continue
        if body is None or offset < 0 or length < 8 or offset + 8 > body.size:
            raise ApiError(400, "body: Arrow IPC stream: a compressed buffer lies outside the message body")
        declared = struct.unpack_from("<q", body, offset)[0]
        if declared < -1:
            raise ApiError(400, "body: Arrow IPC stream: a compressed buffer declares a negative size")
        size += length - 8 if declared == -1 else declared
    return size


def _accepts(given: pa.DataType, wanted: pa.DataType) -> bool:
    """Column types that convert to the schema's without growing; dictionaries and views, which
    can repeat one value for every row, are not among them."""
    if pa.types.is_null(given):
        return True
    if pa.types.is_string(wanted):
        return pa.types.is_string(given) or pa.types.is_large_string(given)
    if pa.types.is_integer(wanted):
        return pa.types.is_integer(given)
    if pa.types.is_floating(wanted):
        return pa.types.is_floating(given) or pa.types.is_integer(given)
    return given == wanted


def _check_schema(given: pa.Schema, wanted: pa.Schema) -> None:
    if len(set(given.names)) != len(given.names):
        raise ApiError(400, "body: Arrow schema names a column twice")
    _check_columns(given.names, wanted, "body")
    for f in given:
        target = wanted.field(f.name).type
        if not _accepts(f.type, target):
            fractional = pa.types.is_floating(f.type) or pa.types.is_decimal(f.type)
            integers = pa.types.is_integer(target) and fractional
            raise ApiError(422 if integers else 400, f"body: column {f.name!r} is {f.type}; the input schema "
                           f"wants {target}" + (" (integers are integers)" if integers else ""), param=f.name)


def _read_arrow(body: bytes, wanted: pa.Schema, limits: RowLimits) -> pa.Table:
    reader = pa.ipc.MessageReader.open_stream(pa.py_buffer(body))
    first = reader.read_next_message()
    _, columns = _header(first, _SCHEMA).vector(1, 4)  # Schema.fields, offsets to Field tables
    if columns > limits.max_columns:
        raise ApiError(413, f"body: {columns} columns; at most {limits.max_columns} "
                            "(SLUICE_MAX_ARROW_COLUMNS)", code="request_too_large")
    schema = pa.ipc.read_schema(first)
    _check_schema(schema, wanted)
    batches, rows, decoded = [], 0, 0
    for message in reader:
        batch = _header(message, _RECORD_BATCH)
        nodes = batch.structs(1, "<qq")  # FieldNode {length, null_count}
        rows += max([0, batch.scalar(0, "<q"), *(n for n, _ in nodes)])
        decoded += _decoded_size(batch, message.body)
        if rows > limits.max_rows:
            raise ApiError(413, f"rows: at most {limits.max_rows} rows per request "
                                "(SLUICE_MAX_ROWS_PER_REQUEST)", param="rows", code="request_too_large")
        if decoded > limits.max_decoded_bytes:
            raise ApiError(413, f"body: decodes to more than {limits.max_decoded_bytes} bytes "
                                "(SLUICE_MAX_DECODED_BYTES)", code="request_too_large")
        record_batch = pa.ipc.read_record_batch(message, schema)
        record_batch.validate(full=True)  # offsets within their buffers, strings valid UTF-8
        batches.append(record_batch)
    return pa.Table.from_batches(batches, schema)


def _arrow_rows(body: bytes, wanted: pa.Schema, limits: RowLimits) -> list[dict[str, Any]]:
    try:
        table = _read_arrow(body, wanted, limits)
    except (pa.ArrowException, OSError, ValueError, struct.error, StopIteration) as err:
        raise ApiError(400, f"body: not a valid Arrow IPC stream ({err})") from None
    columns = {}
    for f in wanted:
        if f.name not in table.column_names:
            if not f.nullable:
                raise ApiError(400, f"body: column {f.name!r} is required", param=f.name)
            columns[f.name] = pa.nulls(table.num_rows, f.type)
            continue
        try:
            columns[f.name] = table.column(f.name).cast(f.type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as err:
            raise ApiError(422, f"body: column {f.name!r}: {err}", param=f.name) from None
    return pa.table(columns).to_pylist() if columns else [{}] * table.num_rows


def _json_value(value: object, field: pa.Field, where: str) -> object:
    t = field.type
    if value is None:
        return None
    if pa.types.is_string(t):
        if not isinstance(value, str):
            raise ApiError(400, f"{where}: must be a string", param=field.name)
        require_unicode(value, where)
        return value
    if pa.types.is_boolean(t):
        if not isinstance(value, bool):
            raise ApiError(400, f"{where}: must be true or false", param=field.name)
        return value
    kind = "an integer" if pa.types.is_integer(t) else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"{where}: must be {kind}", param=field.name)
    if pa.types.is_integer(t):
        if isinstance(value, float) and not value.is_integer():  # like pydantic: 2.0 is 2, 1.5 is not
            raise ApiError(422, f"{where}: must be an integer, got {value!r}", param=field.name)
        signed = pa.types.is_signed_integer(t)
        bits = t.bit_width
        low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
        if not low <= value <= high:
            raise ApiError(422, f"{where}: {value!r} is out of range for {t}", param=field.name)
        return int(value)
    try:
        return float(value)
    except OverflowError:
        raise ApiError(422, f"{where}: {value!r} is out of range for {t}", param=field.name) from None


def _json_rows(body: bytes, wanted: pa.Schema, limits: RowLimits) -> list[dict[str, Any]]:
    try:
        records = json.loads(body)
    except (ValueError, RecursionError) as err:  # JSONDecodeError, UnicodeDecodeError; deep nesting
        raise ApiError(400, f"body: invalid JSON ({str(err)[:200]})") from None
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise ApiError(400, "body: expected a JSON list of records, e.g. [{\"prompt\": \"...\"}]")
    if len(records) > limits.max_rows:
        raise ApiError(413, f"rows: at most {limits.max_rows} rows per request (SLUICE_MAX_ROWS_PER_REQUEST)",
                       param="rows", code="request_too_large")
    rows = []
    for i, record in enumerate(records):
        _check_columns(list(record), wanted, f"rows[{i}]")
        rows.append({f.name: _json_value(record.get(f.name), f, f"rows[{i}].{f.name}") for f in wanted})
    return rows


def _check_columns(present: list[str], schema: pa.Schema, where: str) -> None:
    unknown = [n for n in present if n not in schema.names]
    if unknown:
        named = ", ".join(repr(n)[:80] for n in unknown[:5])
        raise ApiError(400, f"{where}: unknown field(s) {named}; the input schema has "
                            f"{', '.join(schema.names)}", param=unknown[0][:80])


def _check_values(rows: list[dict[str, Any]], schema: pa.Schema) -> list[dict[str, Any]]:
    if not rows:
        raise ApiError(400, "rows: at least one row is needed", param="rows")
    for f in schema:
        if f.nullable:
            continue
        for i, row in enumerate(rows):
            if row.get(f.name) is None:
                raise ApiError(400, f"rows[{i}].{f.name}: field required", param=f.name)
    for i, row in enumerate(rows):
        prompt = row.get("prompt")
        if isinstance(prompt, str) and not prompt.strip():
            raise ApiError(400, f"rows[{i}].prompt: must not be empty", param="prompt")
        max_tokens = row.get("max_tokens")
        if isinstance(max_tokens, int) and not 1 <= max_tokens <= MAX_TOKENS:
            raise ApiError(422, f"rows[{i}].max_tokens: must be from 1 to {MAX_TOKENS}", param="max_tokens")
    return rows


def parse_rows(body: bytes, content_type: str | None, schema: pa.Schema,
               limits: RowLimits | None = None) -> list[dict[str, Any]]:
    """Rows as dicts, checked against `schema`; a 4xx ApiError naming the problem otherwise."""
    limits = limits or RowLimits()
    if wants_arrow(content_type):
        return _check_values(_arrow_rows(body, schema, limits), schema)
    ctype = (content_type or "").split(";")[0].strip().lower()
    if ctype not in ("application/json", ""):
        raise ApiError(415, f"content type {ctype[:100]!r} is not accepted: send application/json "
                            f"records or an {ARROW_STREAM}")
    return _check_values(_json_rows(body, schema, limits), schema)


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
