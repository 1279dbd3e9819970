"""Redis clients: redis-py's asyncio client, retrying briefly through connection blips."""

from __future__ import annotations

from redis.asyncio import Redis
from redis.asyncio.retry import Retry  # the asyncio one: redis.retry.Retry cannot await
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError


def connect(url: str, *, name: str = "sluice") -> Redis:
    """A client for `url` (redis://, rediss:// with TLS, passwords in the URL)."""
    return Redis.from_url(
        url,
        decode_responses=True,
        client_name=name,
        health_check_interval=15,
        socket_keepalive=True,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=5),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
    )
