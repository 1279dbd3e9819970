"""What a Redis URL names (one server, a cluster's seed nodes, Sentinel's service), Celery's
broker for it, and a synchronous client for tools (the benchmarks' audits, `sluice up`'s
probe). The asyncio clients of the processes are broker/plumbing/connection.py's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import parse_qs, unquote, urlsplit

import redis as redis_sync
from redis.cluster import ClusterNode
from redis.sentinel import Sentinel


@dataclass(frozen=True)
class RedisTarget:
    """What a URL names: one server, a cluster's seed nodes, or Sentinel's service."""
    kind: str  # "single", "cluster" or "sentinel"
    url: str
    nodes: tuple[tuple[str, int], ...] = ()
    service: str = ""
    password: str | None = None
    username: str | None = None
    db: int = 0
    tls: bool = False
    tls_options: tuple[tuple[str, str], ...] = ()


def parse_url(url: str) -> RedisTarget:
    scheme, _, rest = url.partition("://")
    base, _, kind = scheme.partition("+")
    if not kind:
        return RedisTarget("single", url)
    if kind not in ("cluster", "sentinel") or base not in ("redis", "rediss"):
        raise ValueError(f"redis url: unknown scheme {scheme!r} "
                         "(redis, rediss, redis+cluster, redis+sentinel)")
    parts = urlsplit(f"{base}://{rest}")
    auth, _, hosts = parts.netloc.rpartition("@")
    user, _, password = auth.partition(":")
    nodes = []
    for host in hosts.split(","):
        name, _, port = host.rpartition(":")
        if not name or not port.isdigit():
            raise ValueError(f"redis url: {host!r} is not host:port")
        nodes.append((name, int(port)))
    path = [p for p in parts.path.split("/") if p]
    service, db = "", 0
    if kind == "sentinel":
        if not path:
            raise ValueError("redis url: redis+sentinel:// needs the service name as its path (/mymaster)")
        service, path = path[0], path[1:]
    if path:
        db = int(path[0])
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    return RedisTarget(kind, url, tuple(nodes), service, unquote(password) or None, unquote(user) or None, db,
                       base == "rediss", tuple(sorted(query.items())))


def celery_broker(redis_url: str, jobs_broker_url: str | None) -> tuple[str, dict]:
    """Celery's broker URL and transport options for bulk jobs: SLUICE_JOBS_BROKER_URL, else the
    Redis of `redis_url` (Sentinel's service through kombu's sentinel transport). Celery cannot
    use a Redis Cluster: with one, the jobs' broker must be named."""
    if jobs_broker_url:
        return jobs_broker_url, {}
    target = parse_url(redis_url)
    if target.kind == "cluster":
        raise ValueError("SLUICE_REDIS_URL names a Redis Cluster, which Celery cannot use as its broker: "
                         "set SLUICE_JOBS_BROKER_URL to a single Redis (or Sentinel) for bulk jobs")
    if target.kind == "sentinel":
        auth = f":{target.password}@" if target.password else ""
        url = ";".join(f"sentinel://{auth}{h}:{p}/{target.db}" for h, p in target.nodes)
        return url, {"master_name": target.service}
    return redis_url, {}


def sync_connect(url: str, **options: Any) -> redis_sync.Redis:  # (redis-py's client options)
    """A synchronous client for `url`, answers decoded."""
    target = parse_url(url)
    options = {"decode_responses": True, **options}
    tls: dict[str, Any] = dict(target.tls_options)  # (its ssl_* options, for a constructor)
    if target.kind == "cluster":
        cluster = redis_sync.RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in target.nodes],
                                          password=target.password, username=target.username, ssl=target.tls,
                                          **tls, **options)
        # typed as the plain client it stands in for (connect's, likewise)
        return cast(redis_sync.Redis, cluster)
    if target.kind == "sentinel":
        sentinel = Sentinel(list(target.nodes), sentinel_kwargs={"password": target.password})
        return sentinel.master_for(target.service, password=target.password, username=target.username,
                                   db=target.db, ssl=target.tls, **tls, **options)
    return redis_sync.Redis.from_url(url, **options)
