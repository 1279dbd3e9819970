"""How every asyncio Redis connection (plain, TLS, Sentinel's, a cluster node's) writes a
command. Imported by broker/plumbing/connection.py, through which every Sluice client is made.

- Packing in C with hiredis, as redis-py's sync client does; its asyncio client packs in
  Python, an isinstance, an encode and a join per argument. That was half the function calls
  per streamed token in the api and in the worker (a reply call carries six arguments per
  request, the reply reader's XREAD two per stream). The bytes are the same, and what redis-py
  refuses (None, a bool) is refused alike.
- Sending without a task: redis-py sends under `asyncio.wait_for` (a task and an extra turn of
  the event loop per command on Python 3.11: 103-125 us of CPU a pooled PING here, 91-99 with
  this send, by scripts/redis_send_cpu.py). The command is written at once, as redis-py does;
  only a write the kernel could not take whole (a Redis that stopped reading) waits for room,
  within `socket_timeout`.
- A write on a connection that was closed under it (a failover or a restart dropped it while
  the command waited its turn) is a ConnectionError, which redis-py retries and the api answers
  with a 503. redis-py let through uvloop's RuntimeError ("the handler is closed") and the
  AttributeError of a writer it had already dropped, which became 500s.

Tests: tests/broker/test_wire.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from redis.asyncio.connection import AbstractConnection
from redis.connection import HiredisRespSerializer
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

_PACKER = HiredisRespSerializer()  # hiredis is a dependency already: replies are parsed with it


def _pack_command(self: AbstractConnection, *args: object) -> list[bytes]:
    # redis-py annotates pack's arguments as lists: they are the command's parts
    return _PACKER.pack(*args)  # type: ignore[arg-type]


def lost_mid_write(err: BaseException) -> bool:
    """Whether `err`, raised by a write, says the connection was already closed: uvloop's
    transport ("unable to perform operation on <TCPTransport closed=True>; the handler is
    closed"), or redis-py's writer dropped by a disconnect meanwhile (None.writelines)."""
    if isinstance(err, RuntimeError):
        return "the handler is closed" in str(err)
    return isinstance(err, AttributeError) and "writelines" in str(err)


async def _send_packed_command(self: AbstractConnection, command: bytes | str | Iterable[bytes],
                               check_health: bool = True) -> None:
    """redis-py's send_packed_command (redis-py 8.1), its errors alike, without the wait_for."""
    if not self.is_connected:
        await self.connect_check_health(check_health=False)
    if check_health:
        await self.check_health()
    try:
        if isinstance(command, str):
            command = command.encode()
        if isinstance(command, bytes):
            command = [command]
        writer = self._writer
        if writer is None:  # a disconnect meanwhile dropped it
            raise RedisConnectionError("the connection to Redis was lost mid-command (its writer is gone)")
        writer.writelines(command)
        transport = writer.transport
        if transport.get_write_buffer_size() or transport.is_closing():  # (drain raises if it closed)
            async with asyncio.timeout(self.socket_timeout or None):
                await writer.drain()
    except TimeoutError:
        await self.disconnect(nowait=True)
        raise RedisTimeoutError("Timeout writing to socket") from None
    except OSError as err:
        await self.disconnect(nowait=True)
        raise RedisConnectionError(f"Error {err.errno or 'UNKNOWN'} while writing to socket. {err}.") from err
    except (RuntimeError, AttributeError) as err:
        await self.disconnect(nowait=True)
        if not lost_mid_write(err):
            raise
        raise RedisConnectionError(f"the connection to Redis was lost mid-command ({err})") from err
    except BaseException:
        # Not known to be written whole: the connection cannot be used again (redis-py alike).
        await self.disconnect(nowait=True)
        raise


AbstractConnection.pack_command = _pack_command  # type: ignore[method-assign]
AbstractConnection.send_packed_command = _send_packed_command  # type: ignore[method-assign]
