"""Property: whatever the body, the row decoders return rows of the input schema or raise their
own 4xx ApiError, never anything else (random and adversarial Arrow tables and JSON records)."""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.api.arrow import ARROW_STREAM, RowLimits, parse_rows
from sluice.api.errors import ApiError
from sluice.config.schema import DEFAULT_INPUT_SCHEMA, ArrowField, to_arrow

# The default input schema, and a custom one with every kind of field a model may declare.
SCHEMAS = [to_arrow(DEFAULT_INPUT_SCHEMA), to_arrow((
    ArrowField(name="prompt", type="string", nullable=False), ArrowField(name="max_tokens", type="int64"),
    ArrowField(name="n", type="int32"), ArrowField(name="score", type="float64"),
    ArrowField(name="weight", type="float32"), ArrowField(name="flag", type="bool"),
))]
LIMITS = RowLimits(max_rows=50, max_columns=8, max_decoded_bytes=64 * 1024)
KNOWN = ["prompt", "max_tokens", "n", "score", "weight", "flag"]
NAMES = st.sampled_from(KNOWN) | st.sampled_from(KNOWN) | st.sampled_from(KNOWN) | st.text(max_size=8)


def _ints(t: pa.DataType) -> st.SearchStrategy[int]:
    if pa.types.is_signed_integer(t):
        return st.integers(-(2 ** (t.bit_width - 1)), 2 ** (t.bit_width - 1) - 1)
    return st.integers(0, 2**t.bit_width - 1)


TYPES: dict[pa.DataType, st.SearchStrategy[Any]] = {
    pa.string(): st.text(min_size=1).filter(str.strip),
    pa.large_string(): st.text(max_size=30),
    pa.string_view(): st.text(max_size=30),
    pa.binary(): st.binary(max_size=30),
    **{t: _ints(t) for t in (pa.int8(), pa.int32(), pa.uint8(), pa.uint64())},
    pa.int64(): st.integers(1, 100) | _ints(pa.int64()),
    pa.float32(): st.floats(width=32),
    pa.float64(): st.floats(),
    pa.bool_(): st.booleans(),
    pa.null(): st.none(),
    pa.date32(): st.dates(),
    pa.list_(pa.int64()): st.lists(_ints(pa.int64()), max_size=3),
    pa.struct([("prompt", pa.string())]): st.fixed_dictionaries({"prompt": st.text(max_size=5)}),
}


@st.composite
def arrow_cases(draw: st.DrawFn) -> tuple[bytes, pa.Schema]:
    """Mostly tables close to the input schema (so that some decode), with any column type,
    extra columns, nulls, dictionaries, compression, batch splits, corrupted and cut bytes."""
    schema = draw(st.sampled_from(SCHEMAS))
    names = [f.name for f in schema if f.name == "prompt" or draw(st.booleans())]
    names += draw(st.sampled_from([[]] * 3 + [draw(st.lists(NAMES, min_size=1, max_size=3))]))
    rows = draw(st.integers(0, 60))
    columns = {}
    for name in dict.fromkeys(names):
        fits = name in schema.names and draw(st.integers(0, 9)) < 8
        t = schema.field(name).type if fits else draw(st.sampled_from(list(TYPES)))
        values = st.none() | TYPES[t] if draw(st.integers(0, 3)) == 0 else TYPES[t]
        column = pa.array(draw(st.lists(values, min_size=rows, max_size=rows)), t)
        repeat = pa.types.is_string(t) and draw(st.integers(0, 3)) == 0
        columns[name] = column.dictionary_encode() if repeat else column
    table = pa.table(columns) if columns else pa.table({"prompt": pa.array([], pa.string())})
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression=draw(st.sampled_from([None, "lz4", "zstd"])))
    with pa.ipc.new_stream(sink, table.schema, options=options) as writer:
        for batch in table.to_batches(max_chunksize=draw(st.integers(1, 64))):
            writer.write_batch(batch)
    body = bytearray(sink.getvalue().to_pybytes())
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 3]))):  # corrupt a few bytes, metadata and bodies alike
        body[draw(st.integers(0, len(body) - 1))] = draw(st.integers(0, 255))
    cut = draw(st.sampled_from([len(body)] * 3 + [draw(st.integers(0, len(body)))]))
    return bytes(body[:cut]), schema


# JSON values, including what JSON can say and Arrow cannot hold: huge and fractional numbers,
# NaN, lone surrogates, nesting.
SCALARS = (st.none() | st.booleans() | st.integers() | st.integers(-(2**70), 2**70) | st.floats()
           | st.text(st.characters(codec=None), max_size=10) | st.sampled_from(["a\ud800", "\udfff", ""]))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                            max_size=3), max_leaves=8)
FITTING_JSON = {"prompt": st.text(min_size=1).filter(str.strip), "max_tokens": st.integers(1, 100),
                "n": st.integers(-(2**31), 2**31 - 1), "score": st.floats(), "weight": st.floats(width=32),
                "flag": st.booleans()}


@st.composite
def json_cases(draw: st.DrawFn) -> tuple[bytes, pa.Schema]:
    """Mostly lists of records close to the input schema, with any value in any field; then any
    JSON, bytes that are not JSON, and nesting deeper than Python's recursion limit."""
    schema = draw(st.sampled_from(SCHEMAS))
    noisy = draw(st.integers(0, 3)) == 0  # then any value in any field, and fields of no schema
    fields = {f.name: FITTING_JSON[f.name] | VALUES if noisy else FITTING_JSON[f.name] for f in schema}
    record = st.fixed_dictionaries({"prompt": fields.pop("prompt")},
                                   optional={**fields, **({"other": VALUES} if noisy else {})})
    shape = draw(st.integers(0, 9))
    if shape < 6:
        body = json.dumps(draw(st.lists(record, max_size=60))).encode()
    elif shape < 8:
        body = json.dumps(draw(VALUES | st.lists(st.dictionaries(NAMES, VALUES, max_size=4), max_size=5))).encode()
    else:
        body = draw(st.binary(max_size=50) | st.integers(1, 50_000).map(lambda n: b"[" * n + b"]" * n))
    return body, schema


def decodes_or_refuses(body: bytes, schema: pa.Schema, content_type: str) -> None:
    try:
        rows = parse_rows(body, content_type, schema, LIMITS)
    except ApiError as err:
        assert 400 <= err.status < 500, err.message
        json.dumps({"error": err.message, "param": err.param})  # the answer can be written
        return
    assert 1 <= len(rows) <= LIMITS.max_rows
    assert all(list(row) == schema.names for row in rows)
    assert all(isinstance(row["prompt"], str) and row["prompt"].strip() for row in rows)
    assert all(row["max_tokens"] is None or type(row["max_tokens"]) is int for row in rows)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
@given(case=arrow_cases())
def test_arrow_bodies_decode_or_get_a_4xx(case: tuple[bytes, pa.Schema]) -> None:
    decodes_or_refuses(*case, ARROW_STREAM)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
@given(case=json_cases())
def test_json_bodies_decode_or_get_a_4xx(case: tuple[bytes, pa.Schema]) -> None:
    decodes_or_refuses(*case, "application/json")
