"""How every asyncio connection writes (broker/plumbing/wire.py): it packs its commands with hiredis, the
bytes redis-py's own Python packer's for every kind of argument Sluice sends, and what that
refuses (None, a bool) refused the same way; a write on a connection closed under it is a
ConnectionError (retried; a 503 in the api), never the event loop's RuntimeError (a 500)."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest
import redis.asyncio.connection
import uvloop
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.connection import PythonRespSerializer
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError
from redis.exceptions import TimeoutError as RedisTimeoutError

import sluice.broker.plumbing.connection  # noqa: F401 - through which every client is made; installs the packer
from sluice.broker.plumbing.wire import _pack_command, lost_mid_write
from sluice.supervisor.processes import EmbeddedRedis

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


def test_only_a_write_on_a_closed_connection_is_taken_for_a_lost_one() -> None:
    assert lost_mid_write(RuntimeError("unable to perform operation on <TCPTransport closed=True reading=False "
                                       "0x7f>; the handler is closed"))
    assert lost_mid_write(AttributeError("'NoneType' object has no attribute 'writelines'"))
    assert not lost_mid_write(RuntimeError("Event loop is closed"))
    assert not lost_mid_write(ValueError("the handler is closed"))
    assert not lost_mid_write(RuntimeError("dictionary changed size during iteration"))
    assert not lost_mid_write(AttributeError("'NoneType' object has no attribute 'get'"))


def _connections(client: object) -> list:
    if sluice.broker.plumbing.connection.is_cluster(client):
        return [c for node in client.get_nodes() for c in node._connections]
    return list(client.connection_pool._available_connections)


def _after_a_reset(redis_url: str, retries: int) -> object:
    """A command on connections whose transports uvloop closed under redis-py (a failover's
    reset while the command waited its turn), on the event loop the api and the workers run."""

    async def main() -> object:
        client = sluice.broker.plumbing.connection.connect(redis_url, name="sluice-test-wire")
        try:
            await client.set("sluice:test:wire", "1")
            for connection in _connections(client):
                if not retries:
                    connection.retry = Retry(NoBackoff(), 0)
                connection._writer.transport.close()  # closed; redis-py does not know yet
            await asyncio.sleep(0.01)
            try:
                return await client.get("sluice:test:wire")
            except Exception as err:  # noqa: BLE001 - the test looks at which
                return err
        finally:
            await client.aclose()

    return uvloop.run(main())


def test_a_write_on_a_closed_transport_is_a_lost_connection_and_retried(redis_url: str) -> None:
    assert _after_a_reset(redis_url, retries=5) == "1"  # redis-py reconnects and sends it again


def test_unretried_it_is_a_connection_error_not_a_runtime_error(redis_url: str) -> None:
    got = _after_a_reset(redis_url, retries=0)
    if got == "1":  # only a cluster client, which retries a lost node of its own
        assert redis_url.startswith("redis+cluster://")
    else:
        assert isinstance(got, RedisConnectionError), repr(got)
        assert "lost mid-command" in str(got)


def test_a_command_is_sent_without_a_task(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """redis-py sends under asyncio.wait_for, a task per command on Python 3.11; ours does not."""

    def refused(*_: object, **__: object) -> None:
        raise AssertionError("asyncio.wait_for on the send path")

    async def main() -> object:
        client = sluice.broker.plumbing.connection.connect(redis_url, name="sluice-test-wire")
        try:
            await client.set("sluice:test:wire", "x" * 100_000)
            return await client.get("sluice:test:wire")
        finally:
            await client.aclose()

    monkeypatch.setattr(redis.asyncio.connection.asyncio, "wait_for", refused)
    assert uvloop.run(main()) == "x" * 100_000


def test_a_write_a_frozen_redis_cannot_take_gives_up_after_the_socket_timeout(tmp_path: Path) -> None:
    """The kernel takes what it can of a command; a Redis that stopped reading (frozen, not gone:
    its kernel still acknowledges) leaves the rest waiting for room, which ends in a TimeoutError
    after the socket timeout, the connection dropped (not a command stuck for good)."""
    node = EmbeddedRedis(tmp_path, appendonly=False).start()
    try:
        async def main() -> tuple[object, float]:
            client = Redis.from_url(node.url, socket_timeout=1.0, retry=Retry(NoBackoff(), 0))
            await client.ping()
            node.process.send_signal(signal.SIGSTOP)
            began = time.monotonic()
            try:
                await client.set("sluice:test:big", b"x" * 64_000_000)
            except Exception as err:  # noqa: BLE001 - the test looks at which
                return err, time.monotonic() - began
            finally:
                node.process.send_signal(signal.SIGCONT)
                await client.aclose()
            return None, time.monotonic() - began

        got, took = uvloop.run(main())
        assert isinstance(got, RedisTimeoutError), repr(got)
        assert took < 10
    finally:
        node.stop()
