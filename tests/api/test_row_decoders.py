"""The infer route's row decoders (JSON records, Arrow IPC streams): limits checked before
decoding, integers that are integers, and nothing but their own 4xx for any input."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from contextlib import contextmanager

import pyarrow as pa
import pytest

from sluice.api.arrow import ARROW_STREAM, RowLimits, parse_rows
from sluice.api.errors import ApiError
from sluice.config.schema import DEFAULT_INPUT_SCHEMA, to_arrow
from tests.api.arrow_bodies import MiB, bomb, ipc

SCHEMA = to_arrow(DEFAULT_INPUT_SCHEMA)


@contextmanager
def arrow_peak() -> Iterator[pa.MemoryPool]:
    """A pool that records the most memory Arrow held at once while the block ran."""
    previous = pa.default_memory_pool()
    pool = pa.proxy_memory_pool(previous)
    pa.set_memory_pool(pool)
    try:
        yield pool
    finally:
        pa.set_memory_pool(previous)


def refused(body: bytes, content_type: str = ARROW_STREAM, limits: RowLimits | None = None,
            schema: pa.Schema = SCHEMA) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse_rows(body, content_type, schema, limits)
    return caught.value


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_a_compressed_bomb_is_refused_before_it_is_decoded(codec: str) -> None:
    body = bomb(200 * MiB, codec)
    assert len(body) < MiB  # ZSTD: 7 KB; LZ4: 850 KB
    with arrow_peak() as pool:
        err = refused(body)
    assert err.status == 413 and "SLUICE_MAX_DECODED_BYTES" in err.message
    assert pool.max_memory() < MiB, f"decoded {pool.max_memory()} bytes before refusing"


def test_compressed_bodies_within_the_limit_decode() -> None:
    table = pa.table({"prompt": ["a" * 1000, "b"], "max_tokens": [3, None]})
    for codec in (None, "zstd", "lz4"):
        assert parse_rows(ipc(table, codec, max_chunksize=1), ARROW_STREAM, SCHEMA) == [
            {"prompt": "a" * 1000, "max_tokens": 3}, {"prompt": "b", "max_tokens": None}]


def test_a_buffer_that_decompresses_past_its_declared_size_is_a_400() -> None:
    body = bomb(MiB, "zstd")
    zstd_frame = b"\x28\xb5\x2f\xfd"
    declared = struct.pack("<q", MiB) + zstd_frame  # the uncompressed length in front of the prompt's buffer
    assert body.count(declared) == 1
    assert refused(body.replace(declared, struct.pack("<q", 16) + zstd_frame)).status == 400


def test_rows_and_columns_are_capped_before_decoding() -> None:
    limits = RowLimits(max_rows=10, max_columns=3, max_decoded_bytes=MiB)
    eleven = pa.table({"prompt": ["p"] * 11})
    assert refused(ipc(eleven, max_chunksize=4), limits=limits).status == 413
    assert refused(json.dumps([{"prompt": "p"}] * 11).encode(), "application/json", limits).status == 413
    wide = pa.table({f"c{i}": [1] for i in range(4)})
    err = refused(ipc(wide), limits=limits)
    assert err.status == 413 and "SLUICE_MAX_ARROW_COLUMNS" in err.message
    # A null column takes no buffers, whatever length it declares: only the metadata tells.
    nulls = pa.table({"prompt": pa.array(["p"] * 1), "max_tokens": pa.array([None], pa.int64())})
    huge = pa.table({"prompt": pa.nulls(10**9), "max_tokens": pa.nulls(10**9)})
    assert refused(ipc(huge)).status == 413
    assert parse_rows(ipc(nulls), ARROW_STREAM, SCHEMA, limits) == [{"prompt": "p", "max_tokens": None}]


def test_a_null_prompt_in_arrow_is_a_400_naming_it() -> None:
    err = refused(ipc(pa.table({"prompt": pa.array([None], pa.string())})))
    assert err.status == 400 and err.message == "rows[0].prompt: field required"


def test_integers_are_integers() -> None:
    err = refused(json.dumps([{"prompt": "p", "max_tokens": 1.5}]).encode(), "application/json")
    assert err.status == 422 and "max_tokens" in err.message
    err = refused(ipc(pa.table({"prompt": ["p"], "max_tokens": [1.0]})))
    assert err.status == 422 and "max_tokens" in err.message and "double" in err.message
    assert parse_rows(b'[{"prompt": "p", "max_tokens": 2.0}]', "application/json", SCHEMA) == [
        {"prompt": "p", "max_tokens": 2}]
    small = pa.table({"prompt": ["p"], "max_tokens": pa.array([7], pa.uint8())})
    assert parse_rows(ipc(small), ARROW_STREAM, SCHEMA) == [{"prompt": "p", "max_tokens": 7}]


@pytest.mark.parametrize("body", [
    b'[{"prompt": "p", "max_tokens": 100000000000000000000000}]',  # OverflowError in Arrow
    b'[{"prompt": "p", "max_tokens": 1e400}]',
    b'[{"prompt": "p", "max_tokens": NaN}]',
    b'[{"prompt": "a\\ud800"}]',  # a lone surrogate: UnicodeEncodeError in Arrow
])
def test_json_values_a_field_cannot_hold_are_422(body: bytes) -> None:
    assert refused(body, "application/json").status == 422


def test_deeply_nested_json_is_a_400() -> None:
    assert refused(b"[" * 100_000 + b"]" * 100_000, "application/json").status == 400


def test_types_that_could_expand_are_refused() -> None:
    repeated = pa.table({"prompt": pa.array(["x" * 100] * 5).dictionary_encode()})
    assert refused(ipc(repeated)).status == 400
    views = pa.table({"prompt": pa.array(["x" * 100] * 5, pa.string_view())})
    assert refused(ipc(views)).status == 400
