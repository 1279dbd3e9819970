"""A model's lanes as its workers and its expiry sweep read them: every shard's interactive
stream and shard 0's bulk stream, each shard in a slot of its own, and how many shards are in
use while a lowered `shards` drains the old ones."""

from __future__ import annotations

from redis.asyncio import Redis

from sluice.broker.keys import ModelKeys

MAX_SHARDS = 64  # config/model.py's bound on `shards`


def lanes_by_slot(keys: ModelKeys, shards: int) -> list[tuple[ModelKeys, list[str]]]:
    """Each shard's keys and its lanes (one slot each): its interactive stream, and on shard 0
    the bulk stream too."""
    return [(shard, [shard.requests, shard.bulk] if shard.shard == 0 else [shard.requests])
            for shard in keys.shards(shards)]


async def shards_in_use(redis: Redis, keys: ModelKeys, configured: int) -> int:
    """How many interactive shards a worker reads: the configured ones, and beyond them any
    shard a larger `shards` left entries on (so that lowering it drains the old shards)."""
    extra = [keys.at(k).requests for k in range(configured, MAX_SHARDS)]
    async with redis.pipeline(transaction=False) as pipe:
        for stream in extra:
            pipe.xlen(stream)
        lengths: list[int] = await pipe.execute()
    used = [configured + i + 1 for i, n in enumerate(lengths) if n]
    return max([configured, *used])
