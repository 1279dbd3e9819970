"""Every asyncio connection packs its commands with hiredis (broker/packing.py): the bytes are
redis-py's own Python packer's, for every kind of argument Sluice sends, and what it refuses
(None, a bool) is refused the same way."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from redis.connection import PythonRespSerializer
from redis.exceptions import DataError

import sluice.broker.connection  # noqa: F401 - through which every client is made; installs the packer
from sluice.broker.packing import _pack_command

_PYTHON = Connection(decode_responses=True)
PYTHON = PythonRespSerializer(_PYTHON._buffer_cutoff, _PYTHON.encoder.encode)

ARG = st.one_of(st.text(), st.binary(), st.integers(), st.floats(allow_nan=False), st.integers(-2**80, 2**80),
                st.binary(min_size=6000, max_size=9000).map(memoryview), st.binary().map(bytearray))


def test_every_asyncio_connection_packs_with_hiredis() -> None:
    assert Connection.pack_command is _pack_command


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(["XADD", "EVALSHA", "CONFIG GET", b"CLIENT UNBLOCK"]), args=st.lists(ARG, max_size=40))
def test_the_bytes_are_redis_pys_own(name: str | bytes, args: list) -> None:
    ours = b"".join(bytes(part) for part in _PYTHON.pack_command(name, *args))
    assert ours == b"".join(bytes(part) for part in PYTHON.pack(name, *args))


@pytest.mark.parametrize("bad", [None, True, object()])
def test_an_argument_redis_cannot_take_is_refused_alike(bad: object) -> None:
    with pytest.raises(DataError):
        PYTHON.pack("SET", "k", bad)
    with pytest.raises(DataError):
        _PYTHON.pack_command("SET", "k", bad)


async def test_a_round_trip_keeps_every_character(redis: Redis) -> None:
    text = "é✓ \r\n\x00 🚀" * 100
    await redis.set("sluice:test:packing", text)
    assert await redis.get("sluice:test:packing") == text
    async with redis.pipeline(transaction=False) as pipe:
        pipe.set("sluice:test:packing", 1.5).get("sluice:test:packing")
        assert (await pipe.execute())[1] == "1.5"
