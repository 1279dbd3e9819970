"""The entries each tenant holds queued per model: fair share's `<tag>:held` (docs/protocol.md),
staged or on a lane stream, both lanes, summed over a model's shards. One HMGET per shard."""

from __future__ import annotations

from redis.asyncio import Redis

from sluice.broker.keys import ModelKeys


async def queued_by_tenant(redis: Redis, models: list[tuple[str, int]],
                           tenants: list[str]) -> dict[str, dict[str, int]]:
    """tenant → model → entries held, for these (model, shards) and tenant names."""
    out = {t: {m: 0 for m, _ in models} for t in tenants}
    if not tenants:
        return out
    shards = [(m, ModelKeys(m).at(k).held) for m, count in models for k in range(count)]
    async with redis.pipeline(transaction=False) as pipe:
        for _, held in shards:
            pipe.hmget(held, tenants)
        read = await pipe.execute()
    for (model, _), counts in zip(shards, read):
        for tenant, count in zip(tenants, counts):
            out[tenant][model] += int(count or 0)
    return out
