"""api/arrow.py beyond the decoders' bombs (test_row_decoders.py): media types, JSON and Arrow
bodies of the wrong shape each a 4xx naming the problem, and what the infer route sends back."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from sluice.api.arrow import ARROW_STREAM, RowLimits, encode_rows, encode_table, parse_rows, wants_arrow
from sluice.api.errors import ApiError
from sluice.config.schema import DEFAULT_INPUT_SCHEMA, DEFAULT_OUTPUT_SCHEMA, to_arrow
from sluice.config.settings import Settings
from tests.api.arrow_bodies import ipc

IN, OUT = to_arrow(DEFAULT_INPUT_SCHEMA), to_arrow(DEFAULT_OUTPUT_SCHEMA)


def refused(body: bytes, content_type: str | None = "application/json", limits: RowLimits | None = None) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse_rows(body, content_type, IN, limits)
    return caught.value


def read(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(data).read_all()


@pytest.mark.parametrize(("content_type", "arrow"), [
    (ARROW_STREAM, True), ("Application/Vnd.Apache.Arrow.Stream; charset=binary", True),
    ("application/json", False), (None, False), ("application/vnd.apache.arrow.file", False),
])
def test_wants_arrow_reads_the_media_type_only(content_type: str | None, arrow: bool) -> None:
    assert wants_arrow(content_type) is arrow


def test_json_records_and_arrow_give_the_same_rows() -> None:
    records = [{"prompt": "a", "max_tokens": 2}, {"prompt": "b"}]
    from_json = parse_rows(json.dumps(records).encode(), "application/json; charset=utf-8", IN)
    table = pa.table({"prompt": ["a", "b"], "max_tokens": pa.array([2, None], pa.int64())})
    assert from_json == parse_rows(ipc(table), ARROW_STREAM, IN) == [
        {"prompt": "a", "max_tokens": 2}, {"prompt": "b", "max_tokens": None}]
    assert parse_rows(b'[{"prompt": "a"}]', None, IN) == [{"prompt": "a", "max_tokens": None}]  # no type: JSON


@pytest.mark.parametrize(("body", "status", "naming"), [
    (b"{}", 400, "JSON list of records"),
    (b'["prompt"]', 400, "JSON list of records"),
    (b"[]", 400, "at least one row"),
    (b"not json", 400, "invalid JSON"),
    (b"\xff\xfe", 400, "invalid JSON"),
    (b'[{"prompt": "a", "temperature": 1}]', 400, "unknown field(s) 'temperature'"),
    (b'[{"max_tokens": 2}]', 400, "rows[0].prompt: field required"),
    (b'[{"prompt": 5}]', 400, "rows[0].prompt: must be a string"),
    (b'[{"prompt": "a", "max_tokens": "2"}]', 400, "must be an integer"),
    (b'[{"prompt": "a", "max_tokens": true}]', 400, "must be an integer"),
    (b'[{"prompt": "a", "max_tokens": -1}]', 422, "rows[0].max_tokens: must be from 1"),
    (b'[{"prompt": "a", "max_tokens": 1e300}]', 422, "out of range for int64"),
    (b'[{"prompt": "a", "max_tokens": 0}]', 422, "rows[0].max_tokens: must be from 1"),
    (b'[{"prompt": "  "}]', 400, "rows[0].prompt: must not be empty"),
])
def test_json_bodies_of_the_wrong_shape_are_4xx_naming_it(body: bytes, status: int, naming: str) -> None:
    error = refused(body)
    assert error.status == status and naming in error.message, error.message


def test_an_unknown_field_name_is_quoted_and_cut_short() -> None:
    error = refused(json.dumps([{"x" * 1000: 1, "prompt": "a"}]).encode())
    assert error.status == 400 and len(error.message) < 400 and error.param == "x" * 80


def test_other_media_types_are_a_415_naming_both_accepted() -> None:
    error = refused(b"prompt=a", "application/x-www-form-urlencoded")
    assert error.status == 415 and "application/json" in error.message and ARROW_STREAM in error.message


def test_too_many_json_rows_are_a_413_naming_the_setting() -> None:
    error = refused(json.dumps([{"prompt": "a"}] * 3).encode(), limits=RowLimits(max_rows=2))
    assert error.status == 413 and "SLUICE_MAX_ROWS_PER_REQUEST" in error.message


@pytest.mark.parametrize(("body", "naming"), [
    (b"", "not a valid Arrow IPC stream"),
    (b"\x00" * 64, "not a valid Arrow IPC stream"),
    (b"garbage that is not arrow at all", "not a valid Arrow IPC stream"),
])
def test_bytes_that_are_no_arrow_stream_are_a_400(body: bytes, naming: str) -> None:
    error = refused(body, ARROW_STREAM)
    assert error.status == 400 and naming in error.message


def test_a_truncated_arrow_stream_is_a_400() -> None:
    whole = ipc(pa.table({"prompt": ["a" * 100] * 10}))
    for cut in (8, len(whole) // 2, len(whole) - 9):
        error = refused(whole[:cut], ARROW_STREAM)
        assert 400 <= error.status < 500, (cut, error.message)


def test_arrow_columns_of_the_wrong_kind_are_refused_by_name() -> None:
    error = refused(ipc(pa.table({"prompt": [1, 2]})), ARROW_STREAM)
    assert error.status == 400 and "'prompt'" in error.message
    error = refused(ipc(pa.table({"prompt": ["a"], "extra": [1]})), ARROW_STREAM)
    assert error.status == 400 and "'extra'" in error.message
    dictionary = pa.table({"prompt": pa.array(["a", "a"]).dictionary_encode()})
    assert 400 <= refused(ipc(dictionary), ARROW_STREAM).status < 500  # one value repeated for every row


def test_rows_limits_come_from_the_settings() -> None:
    limits = RowLimits.of(Settings(max_rows_per_request=7, max_arrow_columns=3, max_decoded_bytes=1000))
    assert limits == RowLimits(7, 3, 1000)


def test_encode_rows_keeps_the_schema_and_its_order() -> None:
    rows = [{"num_output_tokens": 2, "generated_text": "hi", "ignored": 1}, {"generated_text": None}]
    table = read(encode_rows(rows, OUT))
    assert table.schema == OUT
    assert table.to_pylist() == [{"generated_text": "hi", "num_output_tokens": 2},
                                 {"generated_text": None, "num_output_tokens": None}]


def test_encode_table_writes_nested_values_as_json_text() -> None:
    table = read(encode_table([{"id": "r1", "rows": [{"a": 1}], "usage": {"n": 2}}]))
    assert table.to_pylist() == [{"id": "r1", "rows": '[{"a": 1}]', "usage": '{"n": 2}'}]
