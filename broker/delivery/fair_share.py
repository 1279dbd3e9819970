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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from redis.asyncio import Redis

from sluice.broker import keys
from sluice.broker.delivery.affinity import WINDOW, Placement
from sluice.broker.delivery.calls import Dispatch
from sluice.broker.delivery.deliveries import Delivery, Read, entries_read
from sluice.broker.plumbing import Scripts, members
from sluice.protocol.messages import RequestMessage, Usage

if TYPE_CHECKING:
    from sluice.config.settings import Settings

OUTPUT_WEIGHT = 2  # an output token costs two prompt tokens (the VTC paper's weights)
CHARS_PER_TOKEN = 4  # a prompt's estimated tokens, until its final counts them
RESERVE_BLOCK_MS = 50  # a worker keeping its tenant reserve reads again this soon (see blocking_ms)


def prompt_tokens(row: dict[str, Any]) -> int:
    """A row's prompt tokens, estimated: token ids as they are, text by its characters."""
    prompt = row.get("prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if not isinstance(prompt, str):
        prompt = json.dumps(prompt if prompt is not None else row.get("messages", ""))
    return -(-len(prompt) // CHARS_PER_TOKEN)


def expected_cost(message: RequestMessage) -> int:
    """The tokens a request is charged at admission: per row its prompt plus twice max_tokens."""
    return sum(prompt_tokens(row) + OUTPUT_WEIGHT * int(row.get("max_tokens") or message.sampling.max_tokens)
               for row in message.rows)


def actual_cost(usage: Usage) -> int:
    """The tokens it really cost, from its final's usage."""
    return usage.prompt_tokens + OUTPUT_WEIGHT * usage.completion_tokens


async def staged_streams(redis: Redis, stream: str) -> list[str]:
    """The staging streams of a lane's backlogged tenants (one slot: the lane's)."""
    tenants = members(await redis.zrange(keys.backlog(stream), 0, -1))
    return [keys.staged(stream, tenant) for tenant in tenants]


@dataclass(frozen=True)
class SlotReserves:
    """What a worker's reads keep free of its batching policy's `capacity`: of a fetch's count,
    the slots a bulk read leaves to interactive work (`interactive`), and dispatch.lua's tenant
    reserve (`tenant`): its last free slots, kept for a tenant running fewer than its part."""

    capacity: int = 0
    interactive: int = 0
    tenant: int = 0

    @classmethod
    def of(cls, settings: Settings, capacity: int) -> SlotReserves:
        """The settings' reserves, each at most capacity - 1."""
        most = max(0, capacity - 1)
        return cls(capacity, interactive=min(settings.interactive_reserved_slots, most),
                   tenant=min(settings.tenant_reserved_slots, most))


class FairShareReads:
    """A worker's reads of new entries: each first moves the tenants' staged requests onto the
    lane in fair order (dispatch.lua, keeping the worker's reserves, told what it runs by tenant:
    the entries `held`), by prefix group where the worker places by prefix (`placement`,
    docs/prefix-affinity.md); `bulk` is the bulk lane."""

    def __init__(self, redis: Redis, scripts: Scripts, placement: Placement,
                 held: Mapping[tuple[str, str], Delivery], *, bulk: str) -> None:
        self.redis, self.scripts, self.placement, self.held, self.bulk = redis, scripts, placement, held, bulk
        self.reserves = SlotReserves()

    def room(self, stream: str, count: int) -> int:
        """What a read of `stream` may take of a fetch of `count`: a bulk read leaves the
        interactive reserve."""
        return count - self.reserves.interactive if stream == self.bulk else count

    async def dispatch(self, consumer: str, stream: str, count: int) -> list[Read]:
        """dispatch.lua for `consumer`: staged requests onto the lane in fair order, then its read
        of at most `count` new entries. Placing by prefix on the interactive lane, it keeps where
        its blocking read waits from."""
        running = Counter(d.message.tenant for d in self.held.values())
        rules = self.placement.rules
        wait_ms = rules.wait_ms if stream != self.bulk else None  # None: not placing by prefix here
        got = await self.scripts(Dispatch(
            stream=stream, consumer=consumer, count=count, reserve=self.reserves.tenant,
            capacity=self.reserves.capacity, now=time.time(), wait_ms="" if wait_ms is None else wait_ms,
            live_ms=rules.live_ms, window=WINDOW, running=tuple(x for item in running.items() for x in item)))
        if wait_ms is not None:
            wake_id, due_ms, got = got
            self.placement.wake[stream] = (wake_id, int(due_ms))
        if not got:
            return []
        # answered as XREADGROUP answers, each entry's fields flat
        return [(entry_id, dict(zip(fields[::2], fields[1::2]))) for entry_id, fields in got[0][1]]

    def blocking_ms(self, count: int, block_ms: int) -> int:
        """How long a blocking read of `count` waits, of `block_ms`: at most RESERVE_BLOCK_MS while
        the free slots are within the tenant reserve. A worker that kept its reserve may have left
        a heavy tenant's requests staged: a slot its own requests free meanwhile must not wait out
        a long read to be filled (a light tenant's request, put straight onto the lane, wakes the
        read at once either way)."""
        return min(block_ms, RESERVE_BLOCK_MS) if 0 < count <= self.reserves.tenant else block_ms

    async def blocking_read(self, consumer: str, stream: str, count: int, block_ms: int) -> list[Read]:
        """The blocking read of the interactive `stream` once nothing was read without blocking:
        XREADGROUP on the lane; a worker placing by prefix instead waits on the lane's doorbell
        (admission rings it rather than add to the lane) or until a looked-at entry falls due,
        then dispatches again."""
        block = self.blocking_ms(count, block_ms)
        if self.placement.rules.wait_ms is not None and stream in self.placement.wake:
            await self.placement.wait(stream, block)
            return await self.dispatch(consumer, stream, count)
        return entries_read(await self.redis.xreadgroup(keys.GROUP, consumer, {stream: ">"}, count=count,
                                                        block=block))
