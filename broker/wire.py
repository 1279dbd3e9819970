"""How every asyncio Redis connection (plain, TLS, Sentinel's, a cluster node's) writes a
command. Imported by broker/connection.py, through which every Sluice client is made.

- Packing in C with hiredis, as redis-py's sync client does; its asyncio client packs in
  Python, an isinstance, an encode and a join per argument. That was half the function calls
  per streamed token in the api and in the worker (a reply call carries six arguments per
  request, the reply reader's XREAD two per stream). The bytes are the same, and what redis-py
  refuses (None, a bool) is refused alike.
- A write on a connection that was closed under it (a failover or a restart dropped it while
  the command waited its turn) is a ConnectionError, which redis-py retries and the api answers
  with a 503. redis-py let through uvloop's RuntimeError ("the handler is closed") and the
  AttributeError of a writer it had already dropped, which became 500s.

Tests: tests/broker/test_wire.py.
"""

from __future__ import annotations

from collections.abc import Iterable

from redis.asyncio.connection import AbstractConnection
from redis.connection import HiredisRespSerializer
from redis.exceptions import ConnectionError as RedisConnectionError

_PACKER = HiredisRespSerializer()  # hiredis is a dependency already: replies are parsed with it
_SEND = AbstractConnection.send_packed_command


def _pack_command(self: AbstractConnection, *args: object) -> list[bytes]:
    return _PACKER.pack(*args)


def lost_mid_write(err: BaseException) -> bool:
    """Whether `err`, raised by a write, says the connection was already closed: uvloop's
    transport ("unable to perform operation on <TCPTransport closed=True>; the handler is
    closed"), or redis-py's writer dropped by a disconnect meanwhile (None.writelines)."""
    if isinstance(err, RuntimeError):
        return "closed" in str(err)
    return isinstance(err, AttributeError) and "writelines" in str(err)


async def _send_packed_command(self: AbstractConnection, command: bytes | str | Iterable[bytes],
                               check_health: bool = True) -> None:
    try:
        await _SEND(self, command, check_health)
    except (RuntimeError, AttributeError) as err:  # redis-py has disconnected it already
        if not lost_mid_write(err):
            raise
        raise RedisConnectionError(f"the connection to Redis was lost mid-command ({err})") from err


AbstractConnection.pack_command = _pack_command  # type: ignore[method-assign]
AbstractConnection.send_packed_command = _send_packed_command  # type: ignore[method-assign]
