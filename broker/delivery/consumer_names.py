"""A worker's consumer name in its model's group, held as a lease (SET NX PX) so that two live
workers never share one, and a restarted worker gets its old name back with its pending entries;
the consumers of workers gone for good are removed from the group."""

from __future__ import annotations

import logging

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from sluice.broker.delivery.calls import ConsumerDrop
from sluice.broker.keys import GROUP, ModelKeys
from sluice.broker.plumbing import Scripts

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


async def prune(redis: Redis, scripts: Scripts, keys: ModelKeys,
                lanes: list[tuple[ModelKeys, list[str]]]) -> list[str]:
    """Remove from the group the consumers whose worker is gone (its name's lock expired) and
    that hold nothing; one that still holds entries stays until they are reclaimed. Returns
    the names removed. `lanes`: each shard's keys and streams (one slot each). The check and
    the removal are one script per shard: a worker taking the name meanwhile would first take
    its lock (shard 0's), and one that has fetched on a shard holds an entry there."""
    names: set[str] = set()
    present: list[tuple[ModelKeys, list[str]]] = []
    for shard, streams in lanes:
        grouped = []
        for stream in streams:
            try:
                names.update(c["name"] for c in await redis.xinfo_consumers(stream, GROUP))
            except ResponseError:  # no stream or no group yet: nothing to prune there
                continue
            grouped.append(stream)
        if grouped:
            present.append((shard, grouped))
    removed = []
    for name in sorted(names):
        if len(present) > 1 and await redis.exists(keys.consumer_lock(name)):
            continue  # alive: spare the other shards' scripts (shard 0's checks the lock itself)
        dropped = [await scripts(ConsumerDrop(name_lock=shard.consumer_lock(name), streams=tuple(streams),
                                              group=GROUP, consumer=name))
                   for shard, streams in present]
        if all(dropped):
            removed.append(name)
    if removed:
        log.info("removed %d consumer(s) of dead workers from %s: %s", len(removed), keys.model, removed)
    return removed
