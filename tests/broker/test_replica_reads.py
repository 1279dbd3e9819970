"""What a reader is shown, a failover keeps. Replication is asynchronous: a token read from a
primary that dies before its replica has it is gone after the failover, and the retry may
generate another token at that index, so the client's streamed text and the final disagree
(a chaos run on a cluster found one such request). Where admissions wait for a replica
(SLUICE_REDIS_WAIT_REPLICAS), the reply router reads from a replica.

The test stages the window for certain: the replica of the model's slot is stopped (SIGSTOP),
a token is written to the primary behind more data than the sockets between them hold, the
primary is killed and the replica resumed and promoted. Reading the replica, the router never
shows that token; reading the primary (the control), it does, and the promoted node has never
heard of it."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from pathlib import Path

import pytest

from sluice.broker.keys import ModelKeys
from sluice.broker.limits import AdmissionLimits
from sluice.broker.plumbing.connection import connect, until_redis_answers
from sluice.broker.plumbing.readers import Readers
from sluice.broker.replies.router import ReplyRouter
from sluice.protocol.messages import DeltaEvent, FinalResult, State
from tests.broker.helpers import MODEL, replica_of, staged_cluster

pytestmark = [pytest.mark.xdist_group("redis-cluster"),
              pytest.mark.skipif(not shutil.which("redis-cli"), reason="redis-cli is not installed")]


def delta(i: int, text: str) -> dict[str, str]:
    return {"kind": "delta", "data": DeltaEvent(i=i, text=text, token_ids=[i]).model_dump_json()}


def filler_bytes() -> int:
    """More than a TCP connection's buffers can hold on this machine: the largest receive buffer
    autotuning may reach, the largest send buffer, and 8 MB more (under a replica's 64 MB output
    buffer soft limit, which a stopped replica must not reach: it would be disconnected)."""
    def largest(name: str) -> int:
        return int(Path(f"/proc/sys/net/ipv4/{name}").read_text().split()[2])

    return largest("tcp_rmem") + largest("tcp_wmem") + (8 << 20)


@pytest.mark.parametrize("replicas", [True, False], ids=["replica-reads", "primary-reads"])
async def test_a_reader_is_shown_only_what_a_failover_keeps(tmp_path: Path, replicas: bool) -> None:
    with staged_cluster(tmp_path) as cluster:
        client = connect(cluster.url, name="sluice-test")
        router = ReplyRouter(client, Readers("", client, name="sluice-test-replies", replicas=replicas),
                             shards=1, block_ms=500)
        router.start()
        rid = "req-replica-reads"
        key = ModelKeys(MODEL).reply(rid)
        shown: list[str] = []
        try:
            primary = cluster.primary_of(key)
            replica = replica_of(cluster, primary)

            async def follow() -> None:
                async for ev in router.follow(MODEL, rid, idle_timeout_s=60):
                    if ev.delta is not None:
                        shown.append(ev.delta.text)

            reader = asyncio.create_task(follow())
            await client.xadd(key, delta(0, "a"))
            while shown != ["a"]:  # through the replica, once it has it
                await asyncio.sleep(0.05)
                assert not reader.done()

            # The replica stops reading; more written meanwhile than the socket buffers between the
            # two can ever hold, so what follows stays in the primary's own output buffer, and dies
            # with it. (32 MB did not always: this machine lets a receive buffer grow to 32 MB.)
            os.kill(replica.process.pid, signal.SIGSTOP)
            filler = key[:key.index("}") + 1] + ":filler"
            await client.set(filler, "x" * filler_bytes())
            await client.xadd(key, delta(1, "lost"))  # on the primary alone
            await asyncio.sleep(1.5)
            assert shown == (["a"] if replicas else ["a", "lost"])

            primary.stop(kill=True)
            os.kill(replica.process.pid, signal.SIGCONT)
            await asyncio.to_thread(cluster.wait_failover, primary, key)
            kept = [f["data"] for _, f in await until_redis_answers(lambda: client.xrange(key))]
            # the promoted replica never had "lost" (nor, reading the primary, always "a": what the
            # replica's socket held was dropped when the primary's end was reset)
            if replicas:
                assert kept == [delta(0, "a")["data"]], kept
            else:
                assert delta(1, "lost")["data"] not in kept, kept

            # the retry generates index 1 again, differently, and ends the request
            await until_redis_answers(lambda: client.xadd(key, delta(1, "kept")))
            final = FinalResult(status=State.DONE).model_dump_json()
            await until_redis_answers(lambda: client.xadd(key, {"kind": "final", "data": final}))
            await asyncio.wait_for(reader, 60)
            # the reader skips a delta at an index it has shown: with primary reads the client keeps
            # the token the failover lost, and its text is not the final's
            assert shown == (["a", "kept"] if replicas else ["a", "lost"])
        finally:
            await router.close()
            await client.aclose()


def test_a_readers_own_connections_keep_the_deployments_tls() -> None:
    # rediss:// (or a cluster's ssl=True): a per-node reader, a replica's and an unblock
    # connection are opened with the same TLS settings, never in clear.
    from redis.asyncio import Redis
    from redis.asyncio.connection import SSLConnection

    from sluice.broker.plumbing.connection import tls_settings

    tls_client = Redis(host="127.0.0.1", port=1, ssl=True, ssl_ca_certs="/etc/ssl/ca.pem", ssl_check_hostname=False)
    pool = tls_client.connection_pool
    tls = tls_settings(pool.connection_kwargs, pool.connection_class)
    assert tls["ssl"] is True and tls["ssl_ca_certs"] == "/etc/ssl/ca.pem" and tls["ssl_check_hostname"] is False
    assert Redis(host="10.0.0.2", port=7000, **tls).connection_pool.connection_class is SSLConnection
    node = {"connection_class": SSLConnection, "ssl_ca_certs": "x"}  # a cluster node's kwargs
    assert tls_settings(node)["ssl_ca_certs"] == "x"
    plain = Redis(host="127.0.0.1").connection_pool
    assert tls_settings(plain.connection_kwargs, plain.connection_class) == {}


async def test_a_poll_is_shown_a_final_only_once_a_replica_has_it(tmp_path: Path) -> None:
    """The same window for a poll (GET /v1/requests/{id}, Prefer: wait, OpenAI's non-streamed
    routes): a final read from a primary that dies before its replica has it is taken back, and
    the request runs again, maybe to another text: two visible results. Where admissions wait
    for replicas, a final is shown once a replica holds it (read, then WAIT, on one connection)."""
    from sluice.api.lookup import RequestLookup
    from sluice.broker.intake.status_reads import StatusReads
    from sluice.broker.replies.notifications import DoneListener
    from sluice.config.settings import Settings
    from tests.broker.helpers import done_result, running_request

    with staged_cluster(tmp_path) as cluster:
        client = connect(cluster.url, name="sluice-test")
        settings = Settings(redis_url=cluster.url, data_dir=tmp_path / "data", lease_timeout_s=120.0)
        reads = StatusReads(client, AdmissionLimits.of(settings, wait_replicas=1))
        lookup = RequestLookup(reads, DoneListener(client), None, 3600)  # type: ignore[arg-type]
        try:
            _, m, c, d = await running_request(client, settings)
            assert await c.commit(d, done_result(" kept"))
            shown = await lookup.wait_final(MODEL, m.id, 5)  # the replica is up: shown at once
            assert shown.final and shown.result.output.text == " kept"

            _, m, c, d = await running_request(client, settings)
            key = ModelKeys(MODEL).status(m.id)
            primary = cluster.primary_of(key)
            replica = replica_of(cluster, primary)
            os.kill(replica.process.pid, signal.SIGSTOP)
            await client.set(key[:key.index("}") + 1] + ":filler", "x" * (32 << 20))
            assert await c.commit(d, done_result(" lost"))  # on the primary alone
            assert (await reads.status(MODEL, m.id)).final  # the control: the primary shows it
            shown = await lookup.wait_final(MODEL, m.id, 1.5)
            assert not shown.final and shown.result is None

            primary.stop(kill=True)
            os.kill(replica.process.pid, signal.SIGCONT)
            await asyncio.to_thread(cluster.wait_failover, primary, key)
            after = await until_redis_answers(lambda: reads.status(MODEL, m.id))
            assert not after.final  # the failover took it back: the request runs again

            # The promoted node has no replica (its old primary is dead): no failover can take
            # a final back from it, so it is shown once written, not held.
            assert await until_redis_answers(lambda: c.commit(d, done_result(" again")))
            shown = await lookup.wait_final(MODEL, m.id, 5)
            assert shown.final and shown.result.output.text == " again"
        finally:
            await client.aclose()
