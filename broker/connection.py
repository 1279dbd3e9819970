"""Redis clients: redis-py's asyncio client, retrying briefly through connection blips."""

from __future__ import annotations

import socket

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry  # the asyncio one: redis.retry.Retry cannot await
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

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


def connect(url: str, *, name: str = "sluice", max_connections: int = 64, single: bool = False) -> Redis:
    """A client for `url` (redis://, rediss:// with TLS, passwords in the URL).

    At most `max_connections` connections, a command waiting for a free one (a process holds
    itself to a bound however many requests it serves); `single`: one connection of its own
    (a reader that blocks on it)."""
    options = {
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
    if single:
        return Redis.from_url(url, single_connection_client=True, **options)
    pool = BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=POOL_WAIT_S, **options)
    return Redis.from_pool(pool)
