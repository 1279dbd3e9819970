"""redis+sentinel://: the clients follow a failover. A primary with one replica and three
sentinels (Debian's redis-sentinel) on free ports; the primary is SIGKILLed after an
admission that waited for the replica (redis_wait_replicas), and the same clients go on
against the promoted replica: the admission is there, new ones land, a blocking reader reads."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import time
from pathlib import Path

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sluice.broker.intake.admission import NotDurable
from sluice.broker.plumbing.connection import connect
from sluice.broker.plumbing.readers import Readers
from sluice.broker.plumbing.urls import celery_broker, parse_url
from sluice.broker.replies.router import ReplyRouter
from sluice.config.settings import Settings
from sluice.protocol.messages import FinalResult, State
from sluice.supervisor.topologies import LocalSentinel
from tests.broker.helpers import KEYS, MODEL, admission, message, queued_ids

pytestmark = pytest.mark.skipif(not shutil.which("redis-sentinel"), reason="redis-sentinel is not installed")


def test_a_sentinel_url_names_its_sentinels_and_service() -> None:
    t = parse_url("redis+sentinel://:pw@10.0.0.1:26379,10.0.0.2:26380/mymaster/2")
    assert (t.kind, t.nodes, t.service, t.password, t.db) == (
        "sentinel", (("10.0.0.1", 26379), ("10.0.0.2", 26380)), "mymaster", "pw", 2)
    with pytest.raises(ValueError, match="service name"):
        parse_url("redis+sentinel://10.0.0.1:26379")
    assert celery_broker("redis+sentinel://:pw@10.0.0.1:26379,10.0.0.2:26380/mymaster/2", None) == ("sentinel://:pw@10.0.0.1:26379/2;sentinel://:pw@10.0.0.2:26380/2",
                                      {"master_name": "mymaster"})
    with pytest.raises(ValueError, match="SLUICE_JOBS_BROKER_URL"):
        celery_broker("redis+cluster://10.0.0.1:7000", None)
    assert celery_broker("redis+cluster://10.0.0.1:7000", "redis://jobs:6379/0") == ("redis://jobs:6379/0", {})


async def until_written(attempt, timeout_s: float = 30.0):
    """Retry through the failover: refused connections, and the old primary's last moments."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await attempt()
        except (RedisConnectionError, RedisTimeoutError, ReadOnlyError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def test_clients_follow_a_failover(tmp_path: Path, settings: Settings) -> None:
    topology = LocalSentinel(tmp_path).start()
    client = connect(topology.url, name="sluice-test-sentinel")
    router = ReplyRouter(client, Readers(topology.url, client, name="sluice-test-replies"), shards=1, block_ms=500)
    router.start()
    # Where admissions wait for a replica, readers read from one (what they show, a failover keeps).
    from_replica = ReplyRouter(client, Readers(topology.url, client, name="sluice-test-replica-replies",
                                               replicas=True), shards=1, block_ms=500)
    from_replica.start()
    done = FinalResult(status=State.DONE).model_dump_json()
    try:
        adm = admission(client, settings)
        # the 202's promise: on the replica before it is answered
        adm.limits = dataclasses.replace(adm.limits, wait_replicas=1)
        before = message()
        await adm.submit(before, max_queued=100)
        await client.xadd(KEYS.reply(before.id), {"kind": "final", "data": done})
        events = [ev async for ev in from_replica.follow(MODEL, before.id, idle_timeout_s=10)]
        assert [ev.kind for ev in events] == ["final"]
        reader = from_replica._shards["", 0].reader
        assert reader.connection_pool.connection_kwargs["port"] == topology.replica.port
        old_port = topology.primary.port
        topology.primary.stop(kill=True)
        after = message()
        # The promoted replica has no replica of its own: an admission cannot be promised...
        with pytest.raises(NotDurable, match="on 0 of 1 replicas"):
            await until_written(lambda: adm.submit(after, max_queued=100))
        # ...and the client's retry (the same id) enqueues nothing twice
        adm.limits = dataclasses.replace(adm.limits, wait_replicas=0)
        await adm.submit(after, max_queued=100)
        assert await queued_ids(client) == [before.id, after.id]
        info = await client.info("server")
        assert int(info["tcp_port"]) == topology.replica.port != old_port  # the promoted replica

        # A reader on a connection of its own (the reply router's) reads from the new primary;
        # so does one that prefers a replica: there is none, and no failover can happen.
        await client.xadd(KEYS.reply(after.id), {"kind": "final", "data": done})
        await client.hset(KEYS.status(after.id), mapping={"state": "done", "result": done})
        for r in (router, from_replica):
            events = [ev async for ev in r.follow(MODEL, after.id, idle_timeout_s=10)]
            assert [ev.kind for ev in events] == ["final"]
    finally:
        await router.close()
        await from_replica.close()
        await client.aclose()
        topology.stop()
