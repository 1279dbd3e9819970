"""Arrow IPC bodies for the tests: plain, compressed, and compression bombs."""

from __future__ import annotations

import struct

import pyarrow as pa

ARROW = "application/vnd.apache.arrow.stream"
MiB = 1024 * 1024


def ipc(table: pa.Table, compression: str | None = None, max_chunksize: int | None = None) -> bytes:
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression=compression)
    with pa.ipc.new_stream(sink, table.schema, options=options) as writer:
        for batch in table.to_batches(max_chunksize=max_chunksize):
            writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def bomb(decoded_bytes: int, compression: str) -> bytes:
    """One prompt of `decoded_bytes` NUL characters, compressed: a few KB on the wire.

    Built on a zeroed buffer, so that making it does not touch `decoded_bytes` of memory either.
    """
    offsets = pa.py_buffer(struct.pack("<ii", 0, decoded_bytes))
    prompt = pa.Array.from_buffers(pa.string(), 1, [None, offsets, pa.py_buffer(bytes(decoded_bytes))])
    return ipc(pa.table({"prompt": prompt}), compression)
