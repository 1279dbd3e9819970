"""Connections of their own for blocking readers (the api's reply router), and where they read:
the server, a cluster node, or a replica where the deployment waits for one."""

from __future__ import annotations

import logging
import random

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.connection import AbstractConnection, SSLConnection
from redis.exceptions import RedisError

from sluice.broker.plumbing.connection import (
    POOL_WAIT_S,
    client_options,
    connect,
    is_cluster,
    node_client,
    refresh_slots,
    tls_settings,
)

log = logging.getLogger(__name__)


class Readers:
    """Connections of their own for blocking readers (the api's reply router): to the server
    (or Sentinel's primary), or in a cluster to the primary that serves a key's slot now, with
    the CLIENT UNBLOCK that interrupts one sent to that same node.

    With `replicas` (the deployment waits for a replica before answering:
    SLUICE_REDIS_WAIT_REPLICAS), a reader reads from a replica of its node, so that a client is
    shown only what a failover keeps: replication is asynchronous, and a token read from a
    primary that dies before its
    replica has it would be generated again, maybe differently, by the retry. `visible()` says
    whether what a reader has just read may be shown."""

    def __init__(self, url: str, client: Redis, *, name: str, replicas: bool = False) -> None:
        self.url = url
        self.client = client
        self.name = name
        self.cluster = is_cluster(client)
        self.replicas = replicas
        self._controls: dict[tuple[str, int], Redis] = {}

    async def open(self, key: str) -> Redis:
        if is_cluster(self.client):
            await self.client.initialize()  # the slots, before the first command has learnt them
            reader = node_client(self.client, key, name=self.name)
        else:
            reader = connect(self.url, name=self.name, single=True)
        if not self.replicas:
            return reader
        replica = await self._replica_of(reader)
        if replica is None:
            return reader
        await reader.aclose()
        return replica

    async def _replica_of(self, primary: Redis) -> Redis | None:
        """A connection to one of `primary`'s replicas (as its ROLE lists them), or None."""
        role = await primary.execute_command("ROLE")
        if role[0] != "master" or not role[2]:
            return None
        host, port, *_ = random.choice(role[2])
        kw = primary.connection_pool.connection_kwargs
        options = client_options(self.name, True)
        if self.cluster:  # a cluster's replica answers for its slots only after READONLY
            options["redis_connect_func"] = _readonly
        tls = tls_settings(kw, primary.connection_pool.connection_class)
        replica = Redis(host=host, port=int(port), password=kw.get("password"), username=kw.get("username"),
                        single_connection_client=True, **tls, **options)
        try:
            await replica.ping()
        except RedisError as err:
            log.debug("replica %s:%s does not answer (%s): reading from its primary", host, port, err)
            await replica.aclose()
            return None
        return replica

    async def visible(self, reader: Redis) -> bool:
        """Whether what `reader` has just read survives a failover: it reads a replica, or a
        primary with no replica (none could take over from it: it comes back from its own
        AOF). False on a primary that has replicas now (it was promoted, or its replica came
        back): the reader is reopened on a replica and reads again."""
        if not self.replicas:
            return True
        role = await reader.execute_command("ROLE")
        return role[0] != "master" or not role[2]

    async def unblock(self, reader: Redis, client_id: int) -> None:
        kw = reader.connection_pool.connection_kwargs
        # Sentinel's primary: the client's own
        if "host" not in kw or (not self.cluster and not self.replicas):
            await self.client.client_unblock(client_id)
            return
        address = (kw["host"], kw["port"])
        control = self._controls.get(address)
        if control is None:
            tls = tls_settings(kw, reader.connection_pool.connection_class)
            if tls:
                tls = {"connection_class": SSLConnection, **{k: v for k, v in tls.items() if k != "ssl"}}
            control = self._controls[address] = Redis.from_pool(BlockingConnectionPool(  # few: many wait
                host=address[0], port=address[1], password=kw.get("password"), username=kw.get("username"),
                max_connections=2, timeout=POOL_WAIT_S, **tls,
                **client_options(f"{self.name}-unblock", False)))
        await control.client_unblock(client_id)

    async def refresh(self) -> None:
        """After a reader's node failed: learn the cluster's slots again (a replica took over)."""
        if self.cluster:
            await refresh_slots(self.client)

    async def aclose(self) -> None:
        for control in self._controls.values():
            await control.aclose()
        self._controls.clear()


async def _readonly(connection: AbstractConnection) -> None:
    await connection.on_connect()
    await connection.send_command("READONLY")
    await connection.read_response()
