"""Redis clients: redis-py's asyncio client, retrying briefly through connection blips.

One URL names the deployment, and every process (api, workers, jobs) takes it as it is:
- `redis://` / `rediss://` (TLS): one server;
- `redis+cluster://[:password@]host:port,host:port,...`: a Redis Cluster, through redis-py's
  cluster client (the nodes listed are where it starts; it learns the rest). Every key of a
  model shares the hash tag `{m:<model>}`, so each script and pipeline of Sluice stays in
  one slot;
- `redis+sentinel://[:password@]host:port,host:port,.../<service>[/db]`: the primary that
  Sentinel names for `service`, followed through a failover.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeGuard, TypeVar, cast

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.asyncio.connection import SSLConnection
from redis.asyncio.retry import Retry  # the asyncio one: redis.retry.Retry cannot await
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.typing import EncodableT

import sluice.broker.plumbing.wire  # noqa: F401 - how every asyncio connection writes (hiredis; a lost one)
from sluice.broker.plumbing.urls import parse_url

# Commands waiting for a connection wait at most this long (then a ConnectionError, retried
# like any other): redis-py's plain pool raises at once past its bound (100 since redis-py 6),
# which a worker running 256 requests at once reached.
POOL_WAIT_S = 20.0
# A host cut off from Redis (its link down, no reset) must find out in about a lease, not
# after the kernel's 15 minutes of retransmits: its lease is taken over meanwhile, and what it
# writes afterwards is refused anyway (fencing). Unacknowledged writes give up after
# USER_TIMEOUT_S; an idle connection is probed after 10 s, three times 5 s apart.
USER_TIMEOUT_S = 20
# No command of Sluice's blocks longer than a few seconds on the shared pool (XREADGROUP
# BLOCK is under a second; the reply router's XREAD BLOCK runs on connections of its own).
COMMAND_TIMEOUT_S = 30.0
_KEEPALIVE = {name: value for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3),
                                              ("TCP_USER_TIMEOUT", USER_TIMEOUT_S * 1000))
              if hasattr(socket, name)}


log = logging.getLogger(__name__)
T = TypeVar("T")
_HOLDING: contextvars.ContextVar[bool] = contextvars.ContextVar("sluice_cluster_place", default=False)

# A cluster client holds a pool per node that raises past its bound: the client as a whole is
# held to the process's bound (_BoundedCluster), each node's pool to this many times that.
_CLUSTER_POOL_FACTOR = 8


class _BoundedCluster(RedisCluster):
    """redis-py's cluster client with the bound of a blocking pool: at most `bound` commands
    (pipelines included) at once in the whole client, the rest waiting for one to end; its own
    per-node pools only raise past their bound, as redis-py's plain pool did (a worker running
    256 requests at once lost one to a whole lease that way)."""

    def __init__(self, *args: Any, bound: int, **kwargs: Any) -> None:  # RedisCluster's, passed on
        super().__init__(*args, **kwargs)
        self._bound = asyncio.Semaphore(bound)
        self._ready = False
        self._ready_lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def _place(self) -> AsyncIterator[None]:
        """One of the bound's places, held by a command or a pipeline. Re-entrant: a pipeline
        that resends a redirected command (MOVED, ASK during a failover) through
        execute_command already holds its place, and would otherwise wait for itself."""
        if not self._ready:
            await self.ready()
        token = None if _HOLDING.get() else _HOLDING.set(True)
        try:
            async with self._bound if token else contextlib.nullcontext():
                yield
        finally:
            if token:
                _HOLDING.reset(token)

    async def execute_command(self, *args: EncodableT, **kwargs: Any) -> Any:  # RedisCluster's
        async with self._place():
            return await super().execute_command(*args, **kwargs)

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> ClusterPipeline:
        """A pipeline whose execution takes one of the bound's places, as a command does."""
        if shard_hint:  # as RedisCluster.pipeline
            raise RedisClusterException("shard_hint is deprecated in cluster mode")
        return _BoundedPipeline(self, transaction)  # type: ignore[abstract]  # see _BoundedPipeline

    async def ready(self) -> None:
        """Learn the slots once before any command: many first commands at once on a new
        client (redis-py 8.1) broke connections ('NoneType' object has no attribute 'writelines')."""
        async with self._ready_lock:
            if not self._ready:
                await self.initialize()
                self._share_startup_nodes()
                self._ready = True

    def _share_startup_nodes(self) -> None:
        """redis-py keeps the nodes it was started with as objects of their own, each holding
        the connection that asked for the slots (past the bound, idle for good): they become
        the nodes the client uses, and their own connections are closed."""
        manager = self.nodes_manager
        for name, node in list(manager.startup_nodes.items()):
            used = manager.nodes_cache.get(name)
            if used is not None and used is not node:
                manager.startup_nodes[name] = used
                task = asyncio.create_task(node.disconnect())
                manager._background_tasks.add(task)
                task.add_done_callback(manager._background_tasks.discard)

    async def refresh_slots(self) -> None:
        """Learn the slots again (after a failover), within the bound like any command."""
        async with self._place():
            await self.nodes_manager.initialize()


class _BoundedPipeline(ClusterPipeline):
    """A pipeline of a _BoundedCluster. (mypy takes ClusterPipeline for abstract: redis-py's
    types declare `_event_dispatcher` on a protocol it inherits and never sets; RedisCluster's
    own pipeline() makes one just as this does.)"""

    def __init__(self, client: _BoundedCluster, transaction: bool | None = None) -> None:
        super().__init__(client, transaction)
        self._bounded = client

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list[Any]:
        async with self._bounded._place():
            return await super().execute(raise_on_error, allow_redirections)


class _SentinelBlockingPool(SentinelConnectionPool, BlockingConnectionPool):
    """Sentinel's pool (the primary's address asked of Sentinel, a failover followed) with the
    blocking bound of BlockingConnectionPool."""


def is_cluster(client: object) -> TypeGuard[RedisCluster]:
    return isinstance(client, RedisCluster)


async def refresh_slots(client: Redis) -> None:
    """A cluster client of connect()'s learns the slots again (after a failover)."""
    if isinstance(client, _BoundedCluster):
        await client.refresh_slots()


def connect(url: str, *, name: str = "sluice", max_connections: int = 64, single: bool = False) -> Redis:
    """A client for `url` (see the module's docstring; passwords in the URL).

    At most `max_connections` connections, a command waiting for a free one (a process holds
    itself to a bound however many requests it serves); `single`: one connection of its own
    (a reader that blocks on it; not for a cluster: see `node_client`)."""
    target = parse_url(url)
    options = client_options(name, single)
    if target.kind == "cluster":
        if single:
            raise ValueError("a cluster has no single connection: use node_client for the node of a key")
        cluster = _BoundedCluster(startup_nodes=[ClusterNode(h, p) for h, p in target.nodes],
                                  password=target.password, username=target.username, ssl=target.tls,
                                  **dict(target.tls_options), bound=max_connections,
                                  max_connections=max_connections * _CLUSTER_POOL_FACTOR,
                                  **_cluster_options(options))
        # Typed as the plain client it stands in for: it serves the same commands, and the few
        # places where a cluster differs ask is_cluster.
        return cast(Redis, cluster)
    if target.kind == "sentinel":
        sentinel = Sentinel(list(target.nodes), sentinel_kwargs={"password": target.password,
                                                                 "socket_connect_timeout": 5},
                            password=target.password, username=target.username, db=target.db, ssl=target.tls,
                            **dict(target.tls_options), **options)
        if single:
            client = sentinel.master_for(target.service)
            return Redis(connection_pool=client.connection_pool, single_connection_client=True)
        return sentinel.master_for(target.service, connection_pool_class=_SentinelBlockingPool,
                                   max_connections=max_connections, timeout=POOL_WAIT_S)
    if single:
        return Redis.from_url(url, single_connection_client=True, **options)
    pool = BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=POOL_WAIT_S,
                                           **options)
    return Redis.from_pool(pool)


def node_client(cluster: RedisCluster, key: str, *, name: str, single: bool = True) -> Redis:
    """A plain client to the primary that serves `key`'s slot now (a blocking reader of that
    slot's keys, or a control connection beside one). After a failover it is stale: its
    commands fail (connection refused, or MOVED), and the caller asks again."""
    node = cluster.get_node_from_key(key)
    assert node is not None  # (None is for a replica asked for)
    kw = node.connection_kwargs
    options = client_options(name, single)
    return Redis(host=node.host, port=int(node.port), password=kw.get("password"),
                 username=kw.get("username"), single_connection_client=single, **tls_settings(kw), **options)


_TLS_PARAMS = frozenset(p for p in inspect.signature(Redis.__init__).parameters if p.startswith("ssl_"))


def tls_settings(kw: dict, connection_class: type | None = None) -> dict:
    """The TLS settings of a client's connections (`connection_kwargs`, and its pool's class),
    for a connection of its own to another node of the same deployment (rediss://, redis-py's
    ssl_* options)."""
    connection_class = kw.get("connection_class", connection_class)
    if not (isinstance(connection_class, type) and issubclass(connection_class, SSLConnection)):
        return {}
    return {"ssl": True, **{k: v for k, v in kw.items() if k in _TLS_PARAMS}}


def _cluster_options(options: dict) -> dict:
    return {k: v for k, v in options.items() if k not in ("health_check_interval",)}


def client_options(name: str, single: bool) -> dict:
    return {
        # redis-py 8 times out every read after 5 s by default, blocking ones included: a
        # reader blocked in XREAD BLOCK 5000 then timed out, was retried (up to 5 times) and
        # delivered the tokens it was waiting for tens of seconds late. A blocking reader
        # waits as long as its command says; other commands give up after COMMAND_TIMEOUT_S.
        # A dead peer is found by the keepalive and user timeout below either way.
        "socket_timeout": None if single else COMMAND_TIMEOUT_S,
        "decode_responses": True,
        "client_name": name,
        "health_check_interval": 15,
        "socket_keepalive": True,
        "socket_keepalive_options": {getattr(socket, k): v for k, v in _KEEPALIVE.items()},
        "socket_connect_timeout": 10,
        "retry": Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=5),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],
    }


async def wait_for_copies(redis: Redis, key: str, *, replicas: int, aof: bool = False,
                          timeout_ms: int = 1000) -> tuple[int, int]:
    """Wait until the writes made so far to `key`'s node are on `replicas` replicas (WAIT) or,
    with `aof`, also fsynced locally (WAITAOF, Redis 7.2+). Returns (fsynced locally: 1 or 0,
    -1 without `aof`; replicas that have them).

    WAIT and WAITAOF count the writes of the connection they run on, and a pool hands each
    command any connection. So they run in one pipeline (one connection, in a cluster the one
    to `key`'s node) behind a marker write to `key`'s slot: a node replicates and appends in
    order, so once the marker is copied, every earlier write of that node is too."""
    async with _behind_marker(redis, key) as (pipe, target):
        if aof:
            pipe.execute_command("WAITAOF", 1, replicas, timeout_ms, **target)
        else:
            pipe.execute_command("WAIT", replicas, timeout_ms, **target)
        _, got = await pipe.execute()
    if aof:
        local, copies = got
        return int(local), int(copies)
    return -1, int(got)


async def read_copied(redis: Redis, key: str, replicas: int,
                      timeout_ms: int = 1000) -> tuple[dict[str, str], bool]:
    """Hash `key` as its replicas hold it: read on its node, then WAIT there behind a marker, in
    one pipeline (one connection), so what was read is on `replicas` replicas (True) or on the
    primary alone after the timeout (False). A read that is shown to a client once it survives
    a failover (a final result that a failover could take back, to be generated again)."""
    async with _behind_marker(redis, key, read=key) as (pipe, target):
        pipe.execute_command("WAIT", replicas, timeout_ms, **target)
        got, _, copies = await pipe.execute()
    return got, int(copies) >= replicas


async def has_replicas(redis: Redis, key: str) -> bool:
    """Whether `key`'s node lists a replica now (ROLE)."""
    target = {"target_nodes": redis.get_node_from_key(key)} if is_cluster(redis) else {}
    return bool((await redis.execute_command("ROLE", **target))[2])


@contextlib.asynccontextmanager
async def _behind_marker(redis: Redis, key: str, read: str | None = None) -> AsyncIterator[tuple[Any, dict]]:
    """A pipeline on `key`'s node (and connection): HGETALL `read` first if given, then a
    marker write to `key`'s slot, for a WAIT or WAITAOF the caller adds (see wait_for_copies)."""
    tag = key[key.index("{"):key.index("}") + 1] if "{" in key and "}" in key else key
    marker = f"sluice:{tag}:sync"
    target = {"target_nodes": redis.get_node_from_key(marker)} if is_cluster(redis) else {}
    async with redis.pipeline(transaction=False) as pipe:
        if read is not None:
            pipe.hgetall(read)
        pipe.set(marker, "1", ex=3600)
        yield pipe, target


async def copied(redis: Redis, key: str, replicas: int, what: str, timeout_ms: int = 1000) -> bool:
    """Wait for `replicas` replicas to hold what was written to `key`'s node; False (logged)
    when fewer did within the timeout: the write stands on the primary alone."""
    _, got = await wait_for_copies(redis, key, replicas=replicas, timeout_ms=timeout_ms)
    if got < replicas:
        log.warning("%s is on %d of %d replicas after %d ms", what, got, replicas, timeout_ms)
    return got >= replicas


async def until_redis_answers(call: Callable[[], Awaitable[T]], timeout_s: float = 60.0) -> T:
    """`call()`, again while Redis does not answer (restarting, or a cluster failing over: one
    node answers a ping while the one that holds a key's slot is being replaced)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await call()
        except (RedisConnectionError, RedisTimeoutError) as err:
            if time.monotonic() > deadline:
                raise
            log.warning("waiting for Redis (%s)", err)
            await asyncio.sleep(1.0)
