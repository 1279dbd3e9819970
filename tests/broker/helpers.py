"""Shared helpers of the broker unit tests (a private Redis from tests/conftest.py)."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_sync
from redis.asyncio import Redis

from sluice.broker.delivery.affinity import PlacementRules
from sluice.broker.delivery.consumer import Delivery, StreamConsumer
from sluice.broker.delivery.fair_share import staged_streams
from sluice.broker.intake.admission import Admission
from sluice.broker.intake.cancels import Cancels
from sluice.broker.intake.status_reads import StatusReads
from sluice.broker.keys import GROUP, ModelKeys
from sluice.broker.limits import AdmissionLimits, ConsumerLimits
from sluice.broker.plumbing.connection import is_cluster
from sluice.broker.plumbing.readers import Readers
from sluice.broker.replies.router import ReplyRouter
from sluice.broker.replies.writer import ReplyEvent, ReplyWriter
from sluice.config.settings import Settings
from sluice.protocol.messages import (
    DeltaEvent,
    FinalResult,
    RequestMessage,
    RowOutput,
    SamplingSpec,
    State,
    Usage,
)
from sluice.supervisor.processes import EmbeddedRedis as Node
from sluice.supervisor.topologies import LocalCluster

MODEL = "t"
# SLUICE_TEST_AFFINITY=1: the consumers place by prefix group and messages carry one of four
# (docs/prefix-affinity.md), so that the delivery tests run with prefix affinity on.
AFFINITY = os.environ.get("SLUICE_TEST_AFFINITY") == "1"
KEYS = ModelKeys(MODEL)


def url_of(redis: Redis) -> str:
    """The URL of `redis`'s server (a cluster's readers find their nodes from the client)."""
    if is_cluster(redis):
        return ""
    pool = redis.connection_pool.connection_kwargs
    return f"redis://{pool.get('host', '127.0.0.1')}:{pool['port']}/{pool.get('db', 0)}"


async def read_events(redis: Redis, rid: str, *, model: str = MODEL, **kw: Any) -> list[ReplyEvent]:
    """A request's reply events as the api reads them (through a reply router on `redis`'s
    server), until the final, or `idle_timeout_s` without an entry."""
    router = ReplyRouter(redis, Readers(url_of(redis), redis, name="sluice-test-replies"), shards=1, block_ms=1000)
    router.start()
    try:
        return [ev async for ev in router.follow(model, rid, **kw)]
    finally:
        await router.close()


def message(*, deadline_in: float = 60.0, lane: str = "interactive", rows: int = 1) -> RequestMessage:
    now = time.time()
    return RequestMessage(
        id=f"req-{uuid.uuid4().hex}",
        model=MODEL,
        rows=[{"prompt": f"hello {i}", "max_tokens": 4} for i in range(rows)],
        sampling=SamplingSpec(max_tokens=4, seed=7),
        enqueued_at=now,
        deadline=now + deadline_in,
        lane=lane,
        prefix=[f"{secrets.randbelow(4):012x}"] if AFFINITY else [],  # one of four prefix groups
    )


def admission(redis: Redis, settings: Settings) -> Admission:
    return Admission(redis, AdmissionLimits.of(settings))


def cancels(redis: Redis, settings: Settings) -> Cancels:
    return Cancels(redis, AdmissionLimits.of(settings))


def statuses(redis: Redis, settings: Settings) -> StatusReads:
    return StatusReads(redis, AdmissionLimits.of(settings))


def consumer(redis: Redis, settings: Settings, name: str = "w1") -> StreamConsumer:
    c = StreamConsumer(redis, MODEL, name, ConsumerLimits.of(settings, lease_timeout_s=30.0))
    if AFFINITY:  # placing by prefix group: another worker's group waits up to the bound for it
        c.configure(placement=PlacementRules(wait_ms=20))
    return c


async def ready_consumer(redis: Redis, settings: Settings, name: str = "w1") -> StreamConsumer:
    c = consumer(redis, settings, name)
    await c.ensure_groups()
    return c


async def submit_n(adm: Admission, n: int, **kw) -> list[RequestMessage]:
    out = []
    for _ in range(n):
        m = message(**kw)
        await adm.submit(m, max_queued=1000)
        out.append(m)
    return out


async def pending(redis: Redis, stream: str = KEYS.requests) -> list[dict]:
    return await redis.xpending_range(stream, GROUP, "-", "+", 100)


async def replies(redis: Redis, rid: str) -> list[tuple[str, dict]]:
    return await redis.xrange(KEYS.reply(rid))


def done_result(text: str = " tok tok") -> FinalResult:
    return FinalResult(status=State.DONE, output=RowOutput(text=text, num_output_tokens=2,
                                                           finish_reason="length"),
                       usage=Usage(prompt_tokens=2, completion_tokens=2))


async def fetch_one(c: StreamConsumer) -> Delivery:
    (d,) = await c.fetch(1, 1000)
    return d


async def assert_request_keys_expire(redis: Redis) -> None:
    """Every key but the model's request streams (and the group they carry) has a TTL."""
    without_ttl = []
    async for key in redis.scan_iter("*"):
        if key in (KEYS.requests, KEYS.bulk):
            continue
        if await redis.ttl(key) == -1:  # -2: it expired between the scan and now (a slow run)
            without_ttl.append(key)
    assert without_ttl == []


async def running_request(redis: Redis, settings: Settings, name: str = "w1"):
    """One request admitted, fetched by consumer `name` and started: (admission, message, consumer, delivery)."""
    adm = admission(redis, settings)
    (m,) = await submit_n(adm, 1)
    c = await ready_consumer(redis, settings, name)
    d = await fetch_one(c)
    assert await c.start(d) == "run"
    return adm, m, c, d


async def take_over(redis: Redis, settings: Settings, d: Delivery, name: str = "w2"):
    """A real takeover of `d`: its lease lapses, consumer `name` reclaims the entry (XAUTOCLAIM
    raises its delivery count) and starts it under the next attempt, which fences `d`'s worker
    out. Returns (consumer, delivery)."""
    await redis.xclaim(d.stream, GROUP, d.consumer, 0, [d.entry_id], idle=10_000_000, justid=True)
    c = await ready_consumer(redis, settings, name)
    (again,) = await c.fetch(1, 100)
    assert (again.entry_id, again.attempt) == (d.entry_id, d.attempt + 1)
    assert await c.start(again) == "run"
    return c, again


@contextlib.contextmanager
def staged_cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    """A local Redis Cluster for a staged failover: nodes a test stopped (SIGSTOP) are resumed
    before it is stopped."""
    cluster = LocalCluster(tmp_path).start()
    try:
        yield cluster
    finally:
        for node in cluster.nodes:
            if node.process is not None and node.process.poll() is None:
                os.kill(node.process.pid, signal.SIGCONT)
        cluster.stop()


def replica_of(cluster: LocalCluster, primary: Node) -> Node:
    """The node that replicates `primary`, as its ROLE says."""
    return next(n for n in cluster.nodes if n is not primary and
                redis_sync.Redis(port=n.port, decode_responses=True).execute_command("ROLE")[2] == primary.port)


async def queued_ids(redis: Redis, stream: str = KEYS.requests) -> list[str]:
    """The ids of the requests queued on a lane: on its stream, and staged for their tenants'
    turns (fair share), in the order they were admitted (entry ids are times)."""
    entries = [e for s in [stream, *await staged_streams(redis, stream)] for e in await redis.xrange(s)]
    return [f["id"] for _, f in sorted(entries, key=lambda e: tuple(int(x) for x in e[0].split("-")))]


async def queued_len(redis: Redis, stream: str = KEYS.requests) -> int:
    """Entries queued on a lane: on its stream and staged (fair share)."""
    return len(await queued_ids(redis, stream))


async def failing_flush(writer: ReplyWriter, d: Delivery, event: DeltaEvent, *, lands: bool) -> None:
    """Buffer `event` and flush it into a connection error: Redis went away before running the
    pipeline, or (`lands`) ran it and the answer was lost."""
    real = writer._write

    async def failing(calls):
        if lands:
            await real(calls)
        raise ConnectionError("the answer was lost" if lands else "Redis went away")

    writer._write = failing
    writer.delta(d, event)
    try:
        with pytest.raises(ConnectionError):
            await writer.flush()
    finally:
        writer._write = real
