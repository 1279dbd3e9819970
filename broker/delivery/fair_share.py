"""Tenants' fair share of a model's engine (docs/delivery.md, "Fair share"): what a request is
expected to cost its tenant's virtual token counter at admission, what it really cost at its
final, and where a lane's staged requests wait.

The counter is the Virtual Token Counter's (Sheng et al., "Fairness in Serving Large Language
Models", OSDI 2024): prompt tokens plus twice the output tokens, over the tenant's weight.
At admission the output is not known: max_tokens stands in for it, and the prompt's tokens are
estimated from its characters (the api does not tokenize every prompt); the final corrects the
counter by the difference (lua/settle.lua), so a tenant that asks for long outputs and gets
short ones is charged what it got."""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from redis.asyncio import Redis

from sluice.broker import keys
from sluice.broker.delivery.affinity import WINDOW
from sluice.protocol.messages import RequestMessage, Usage

if TYPE_CHECKING:
    from sluice.broker.delivery.consumer import StreamConsumer

OUTPUT_WEIGHT = 2  # an output token costs two prompt tokens (the VTC paper's weights)
CHARS_PER_TOKEN = 4  # a prompt's estimated tokens, until its final counts them
RESERVE_BLOCK_MS = 50  # a worker keeping its tenant reserve reads again this soon (see blocking_ms)


def prompt_tokens(row: dict[str, Any]) -> int:
    """A row's prompt tokens, estimated: token ids as they are, text by its characters."""
    prompt = row.get("prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    text = prompt if isinstance(prompt, str) else json.dumps(prompt if prompt is not None else row.get("messages", ""))
    return -(-len(text) // CHARS_PER_TOKEN)


def expected_cost(message: RequestMessage) -> int:
    """The tokens a request is charged at admission: per row its prompt plus twice max_tokens."""
    return sum(prompt_tokens(row) + OUTPUT_WEIGHT * int(row.get("max_tokens") or message.sampling.max_tokens)
               for row in message.rows)


def actual_cost(usage: Usage) -> int:
    """The tokens it really cost, from its final's usage."""
    return usage.prompt_tokens + OUTPUT_WEIGHT * usage.completion_tokens


async def staged_streams(redis: Redis, stream: str) -> list[str]:
    """The staging streams of a lane's backlogged tenants (one slot: the lane's)."""
    return [keys.staged(stream, tenant) for tenant in await redis.zrange(keys.backlog(stream), 0, -1)]


async def dispatch(c: StreamConsumer, stream: str, count: int) -> list[tuple[str, dict[str, str]]]:
    """dispatch.lua for consumer `c`: staged requests onto the lane in fair order (keeping `c`'s
    tenant reserve, told what it runs by tenant), then its read of at most `count` new entries.
    With prefix affinity on the interactive lane, by prefix group within each tenant's turn
    (docs/prefix-affinity.md), and `c.affinity.wake[stream]` keeps where its blocking read waits from."""
    running = Counter(d.message.tenant for d in c.held.values())
    placing = c.affinity.wait_ms is not None and stream != c.keys.bulk
    got = await c.scripts.dispatch(keys=[stream], args=[c.consumer, count, c.tenant_reserved_slots, c.capacity,
                                                       time.time(), c.affinity.wait_ms if placing else "",
                                                       c.affinity.live_ms, WINDOW,
                                                       *(x for item in running.items() for x in item)])
    if placing:
        wake_id, due_ms, got = got
        c.affinity.wake[stream] = (wake_id, int(due_ms))
    return [(entry_id, dict(zip(fields[::2], fields[1::2]))) for entry_id, fields in got[0][1]] if got else []


def blocking_ms(c: StreamConsumer, count: int, block_ms: int) -> int:
    """How long `c`'s blocking read of one interactive stream waits: its part of `block_ms`
    (sharded streams take turns), and at most RESERVE_BLOCK_MS while its free slots are within
    its tenant reserve. A worker that kept its reserve may have left a heavy tenant's requests
    staged: a slot its own requests free meanwhile must not wait out a long read to be filled
    (a light tenant's request, put straight onto the lane, wakes the read at once either way)."""
    block = block_ms if c.shards == 1 else max(block_ms // c.shards, 10)
    return min(block, RESERVE_BLOCK_MS) if 0 < count <= c.tenant_reserved_slots else block


async def blocking_read(c: StreamConsumer, stream: str, count: int, block_ms: int) -> list[tuple[str, dict[str, str]]]:
    """`c`'s blocking read of the interactive `stream` once nothing was read without blocking:
    `XREADGROUP` on the lane; a worker placing by prefix instead waits on the lane's doorbell
    (admission rings it rather than add to the lane) or until a looked-at entry falls due, then
    dispatches again."""
    block = blocking_ms(c, count, block_ms)
    if c.affinity.wait_ms is not None and stream in c.affinity.wake:
        await c.affinity.wait(c.redis, stream, block)
        return await dispatch(c, stream, count)
    got = await c.redis.xreadgroup(keys.GROUP, c.consumer, {stream: ">"}, count=count, block=block)
    return got[0][1] if got else []
