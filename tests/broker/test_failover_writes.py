"""No hole after a failover. Replication is asynchronous: deltas the old primary acknowledged
and its replica never had are gone after the failover, while the worker that wrote them goes
on from where it was. A chaos run on a cluster saw a stream miss indices 53 to 59 (the final,
assembled by the worker, was whole). reply.lua refuses a delta past the row's next index and
names that index; the writer sends this attempt's deltas again from there.

Staged for certain, as in test_replica_reads: the replica is stopped (SIGSTOP), deltas are
written to the primary behind more data than the sockets between them hold, the primary is
killed, the replica resumed and promoted, and the same writer goes on."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from pathlib import Path

import pytest
import redis as redis_sync

from sluice.broker.plumbing.connection import connect, until_redis_answers
from sluice.broker.replies.writer import ReplyWriter, delivered
from sluice.config.settings import Settings
from sluice.protocol.messages import DeltaEvent
from tests.broker.helpers import KEYS, MODEL, replica_of, running_request, staged_cluster

pytestmark = [pytest.mark.xdist_group("redis-cluster"),
              pytest.mark.skipif(not shutil.which("redis-cli"), reason="redis-cli is not installed")]


async def test_deltas_the_failover_lost_are_written_again(tmp_path: Path) -> None:
    with staged_cluster(tmp_path) as cluster:
        client = connect(cluster.url, name="sluice-test")
        settings = Settings(redis_url=cluster.url, data_dir=tmp_path / "data", lease_timeout_s=120.0)
        try:
            _, m, _, d = await running_request(client, settings)
            key = KEYS.reply(m.id)
            primary = cluster.primary_of(key)
            replica = replica_of(cluster, primary)
            on_replica = redis_sync.Redis(port=replica.port, decode_responses=True)
            on_replica.execute_command("READONLY")
            writer = ReplyWriter(client, MODEL, reply_ttl_s=settings.reply_ttl_s)

            async def write(i: int) -> None:
                writer.delta(d, DeltaEvent(i=i, text=f" t{i}", token_ids=[i]))
                await until_redis_answers(writer.flush)

            for i in range(3):
                await write(i)
            while on_replica.xlen(key) < 3:  # the replica has tokens 0 to 2
                await asyncio.sleep(0.05)

            os.kill(replica.process.pid, signal.SIGSTOP)
            filler = key[:key.index("}") + 1] + ":filler"
            await client.set(filler, "x" * (32 << 20))
            for i in (3, 4):  # acknowledged by the primary alone
                await write(i)
            assert await client.xlen(key) == 5

            primary.stop(kill=True)
            os.kill(replica.process.pid, signal.SIGCONT)
            await asyncio.to_thread(cluster.wait_failover, primary, key)
            assert await until_redis_answers(lambda: client.xlen(key)) == 3  # 3 and 4 are gone

            await write(5)  # the same worker goes on
            row = (await delivered(client, MODEL, m.id))[0]
            assert (row.token_ids, "".join(row.text)) == ([0, 1, 2, 3, 4, 5], " t0 t1 t2 t3 t4 t5")
        finally:
            await client.aclose()
