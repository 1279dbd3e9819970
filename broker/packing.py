"""Every asyncio Redis connection (plain, TLS, Sentinel's, a cluster node's) packs its commands
in C with hiredis, as redis-py's sync client does; its asyncio client packs them in Python, an
isinstance, an encode and a join per argument. That was half the function calls per streamed
token in the api and in the worker (a reply call carries six arguments per request, the reply
reader's XREAD two per stream). The bytes are the same, and what redis-py refuses (None, a
bool) is refused alike (tests/broker/test_command_packing.py). Imported by broker/connection.py,
through which every Sluice client is made.
"""

from __future__ import annotations

from redis.asyncio.connection import AbstractConnection
from redis.connection import HiredisRespSerializer

_PACKER = HiredisRespSerializer()  # hiredis is a dependency already: replies are parsed with it


def _pack_command(self: AbstractConnection, *args: object) -> list[bytes]:
    return _PACKER.pack(*args)


AbstractConnection.pack_command = _pack_command  # type: ignore[method-assign]
