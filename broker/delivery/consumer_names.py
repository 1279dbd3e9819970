"""A worker's consumer name in its model's group, held as a lease (SET NX PX) so that two live
workers never share one, and a restarted worker gets its old name back with its pending entries."""

from __future__ import annotations

import logging

from redis.asyncio import Redis

from sluice.broker.keys import ModelKeys

log = logging.getLogger(__name__)


async def claim(redis: Redis, keys: ModelKeys, base: str, token: str, ttl_s: float) -> str:
    """`base`, or the first free `<base>-<k>` if a live worker holds it."""
    for k in range(1000):
        name = base if k == 0 else f"{base}-{k}"
        if await redis.set(keys.consumer_lock(name), token, nx=True, px=int(ttl_s * 1000)):
            return name
    raise RuntimeError(f"no free consumer name for {base!r}")


async def refresh(redis: Redis, keys: ModelKeys, name: str, token: str, ttl_s: float) -> None:
    key = keys.consumer_lock(name)
    holder = await redis.get(key)
    if holder not in (None, token):
        log.error("consumer name %s is held by another worker", name)
        return
    await redis.set(key, token, px=int(ttl_s * 1000))


async def release(redis: Redis, keys: ModelKeys, name: str, token: str) -> None:
    key = keys.consumer_lock(name)
    if await redis.get(key) == token:
        await redis.delete(key)
