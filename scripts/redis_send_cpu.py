"""CPU per Redis command through Sluice's pooled client, with broker/plumbing/wire.py's send and with
redis-py's own (which sends under asyncio.wait_for: a task per command on Python 3.11),
alternating, on uvloop as the api and the workers run. Starts a private redis-server.

    .venv/bin/python scripts/redis_send_cpu.py [--calls 5000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import uvloop
from redis.asyncio.connection import AbstractConnection

REDIS_PYS_SEND = AbstractConnection.send_packed_command  # before broker/plumbing/wire.py replaces it

from sluice.broker.plumbing.connection import connect  # noqa: E402 - imports broker/plumbing/wire.py
from sluice.supervisor.processes import EmbeddedRedis  # noqa: E402

SLUICES_SEND = AbstractConnection.send_packed_command


async def _cpu_per_call(url: str, calls: int) -> float:
    client = connect(url, name="sluice-send-cpu")
    try:
        for _ in range(200):  # warm: connections made, code paths run
            await client.ping()
        began = time.process_time()
        for _ in range(calls):
            await client.ping()
        return (time.process_time() - began) / calls * 1e6
    finally:
        await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        node = EmbeddedRedis(Path(tmp), appendonly=False).start()
        try:
            for _ in range(args.rounds):
                for name, send in (("redis-py's send", REDIS_PYS_SEND), ("Sluice's send", SLUICES_SEND)):
                    AbstractConnection.send_packed_command = send  # type: ignore[method-assign]
                    print(f"{name:16} {uvloop.run(_cpu_per_call(node.url, args.calls)):6.1f} µs CPU per PING")
        finally:
            AbstractConnection.send_packed_command = SLUICES_SEND  # type: ignore[method-assign]
            node.stop()


if __name__ == "__main__":
    main()
