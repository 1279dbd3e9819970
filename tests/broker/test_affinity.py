"""Prefix affinity's pull side (dispatch.lua, admit.lua, broker/delivery/affinity.py) on a real Redis:
workers take their own groups first, nothing waits past the bound while a worker has room, a
dead worker's groups move (and only they), the doorbell wakes a blocked worker, and with
affinity off nothing of it exists. Waits are the script's own (`due`), never asserted times."""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections import Counter

from redis.asyncio import Redis

from sluice.broker.delivery.affinity import (
    BOUNDED_LOAD,
    GROUP_BLOCKS,
    PlacementRules,
    bounded_owners,
    rendezvous_ranks,
)
from sluice.broker.delivery.consumer import StreamConsumer
from sluice.broker.delivery.dead_letters import DeadLetters
from sluice.broker.delivery.fair_share import SlotReserves
from sluice.broker.keys import WORKERS
from sluice.config.settings import Settings
from sluice.protocol.messages import FinalResult, RequestMessage, RowOutput, SamplingSpec, State, Usage
from sluice.protocol.prefix import PREFIX_DEPTHS
from tests.broker.helpers import KEYS, MODEL, admission, message, ready_consumer
from tests.broker.test_dead_letters import bury

LANE = KEYS.requests
SLOTS, OWNERS = f"{KEYS.tag}:aff:slots", f"{KEYS.tag}:aff:owners"
CAPACITY = 4
GROUPS = [f"{k:012x}" for k in range(0x5100, 0x5108)]


def request(group: str, tenant: str = "default", prefix_tokens: int = 0) -> RequestMessage:
    """A request whose prefix group (the key at GROUP_BLOCKS blocks) is `group`."""
    now = time.time()
    depth = PREFIX_DEPTHS.index(GROUP_BLOCKS)
    prefix = [f"{i:012x}" for i in range(depth)] + [group]
    return RequestMessage(id=f"req-{uuid.uuid4().hex}", model=MODEL, rows=[{"prompt": "x" * 40, "max_tokens": 8}],
                          sampling=SamplingSpec(max_tokens=8, seed=1), enqueued_at=now, deadline=now + 3600,
                          tenant=tenant, prefix=prefix, prefix_tokens=prefix_tokens)


async def placing(redis: Redis, settings: Settings, name: str, *, wait_ms: int = 600_000,
                  live_ms: int = 600_000) -> StreamConsumer:
    c = await ready_consumer(redis, settings, name)
    c.configure(reserves=SlotReserves(capacity=CAPACITY), placement=PlacementRules(wait_ms=wait_ms, live_ms=live_ms))
    assert await dispatch(c, LANE, CAPACITY) == []  # seen: live, CAPACITY free
    return c


async def dispatch(c: StreamConsumer, stream: str, count: int) -> list[tuple[str, dict[str, str]]]:
    """dispatch.lua as `c`'s fetch calls it, before its blocking read."""
    return await c.reads.dispatch(c.consumer, stream, count)


async def submit(redis: Redis, settings: Settings, groups: list[str], prefix_tokens: int = 0) -> list[RequestMessage]:
    adm, out = admission(redis, settings), []
    for g in groups:
        out.append(request(g, prefix_tokens=prefix_tokens))
        await adm.submit(out[-1], max_queued=10_000)
    return out


async def done(redis: Redis, entries: list) -> None:
    """As a commit leaves them: acknowledged and deleted (an undelivered count is XLEN less pending)."""
    if entries:
        await redis.xack(LANE, "workers", *(e for e, _ in entries))
        await redis.xdel(LANE, *(e for e, _ in entries))


def group_of(fields: dict[str, str]) -> str:
    return RequestMessage.from_fields(fields).prefix[-1]


def owner(group: str, live: list[str]) -> str:
    return rendezvous_ranks(group, live)[0]


async def test_each_worker_takes_the_groups_it_owns_and_admission_stages_them(redis: Redis, settings: Settings
                                                                              ) -> None:
    a, b = await placing(redis, settings, "wa"), await placing(redis, settings, "wb")
    await submit(redis, settings, GROUPS * 2)
    assert await redis.xlen(LANE) == 0  # staged although nothing waited: dispatch places them
    assert await redis.xlen(f"{KEYS.tag}:aff:wake") > 0
    mine = {c.consumer: [g for g in GROUPS * 2 if owner(g, ["wa", "wb"]) == c.consumer] for c in (a, b)}
    assert mine["wa"] and mine["wb"]  # the groups split between the two (the ranks Lua computes as Python)
    for c in (a, b):
        got: list[str] = []
        while len(got) < len(mine[c.consumer]):
            entries = await dispatch(c, LANE, CAPACITY)
            assert entries, f"{c.consumer} declined its own groups"
            got += [group_of(f) for _, f in entries]
            await done(redis, entries)
        assert got == mine[c.consumer]  # its own, oldest first, none of the other's
    assert await dispatch(a, LANE, CAPACITY) == []


async def test_no_request_waits_past_the_bound_while_a_worker_has_room(redis: Redis, settings: Settings) -> None:
    """Three workers fetch in a seeded random order with random room; after every dispatch by a
    worker that moved fewer than its room, every entry still staged was younger than the bound
    at the dispatch (Redis' clock, read before it); each entry is moved once."""
    wait_ms = 25
    rng = random.Random(7)
    workers = [await placing(redis, settings, f"w{i}", wait_ms=wait_ms) for i in range(3)]
    adm, sent, moved = admission(redis, settings), set(), []
    staged = f"{KEYS.tag}:staged:req:default"
    for _ in range(120):
        for _ in range(rng.choice((0, 0, 1, 2))):
            m = request(rng.choice(GROUPS))
            await adm.submit(m, max_queued=10_000)
            sent.add(m.id)
        c = rng.choice(workers)
        room = rng.randint(0, CAPACITY)
        secs, micros = await redis.time()
        before_ms = secs * 1000 + micros // 1000
        entries = await dispatch(c, LANE, room) if room else []
        moved += [f["id"] for _, f in entries]
        if len(entries) < room:
            left = await redis.xrange(staged)
            overdue = [e for e, _ in left if int(e.split("-")[0]) + wait_ms <= before_ms]
            assert not overdue, f"{c.consumer} had room for {room - len(entries)} more and left {overdue}"
        await done(redis, entries)
        await asyncio.sleep(rng.random() * 0.01)
    while len(moved) < len(sent):  # the rest: whoever asks takes them once they fall due
        entries = await dispatch(workers[0], LANE, CAPACITY)
        moved += [f["id"] for _, f in entries]
        if not entries:
            await asyncio.sleep(workers[0].affinity.wake[LANE][1] / 1000)
    assert sorted(moved) == sorted(sent)  # each once


async def test_a_worker_declines_within_the_bound_and_takes_at_it(redis: Redis, settings: Settings) -> None:
    # A bound of a second, not tens of ms: on a loaded machine the submit and the first
    # dispatch can be that far apart (Redis' clock decides), and the entries would be overdue.
    await placing(redis, settings, "wa", wait_ms=1000)
    b = await placing(redis, settings, "wb", wait_ms=1000)
    theirs = [g for g in GROUPS if owner(g, ["wa", "wb"]) == "wa"][:2]
    sent = await submit(redis, settings, theirs)
    assert await dispatch(b, LANE, CAPACITY) == []  # a has free slots: its groups wait for it
    due = b.affinity.wake[LANE][1]
    assert 0 < due <= 1000
    await asyncio.sleep(due / 1000)
    taken = [f["id"] for _, f in await dispatch(b, LANE, CAPACITY)]
    assert taken and taken == [m.id for m in sent][:len(taken)]  # overdue: b takes them, oldest first


async def test_an_idle_worker_takes_what_busy_owners_cannot_start(redis: Redis, settings: Settings) -> None:
    a, b = await placing(redis, settings, "wa"), await placing(redis, settings, "wb")
    theirs = [g for g in GROUPS if owner(g, ["wa", "wb"]) == "wa"][:1]
    await submit(redis, settings, theirs)
    assert await dispatch(a, LANE, 0) == []  # a records no free slot
    assert [group_of(f) for _, f in await dispatch(b, LANE, CAPACITY)] == theirs  # b runs nothing: takes it


async def test_an_owner_that_committed_is_free_for_the_next_request_of_its_group(redis: Redis, settings: Settings
                                                                                ) -> None:
    """A full owner commits a request; its client sends the next one of the group at once, before
    the owner fetches again: the owner's slot is free from the commit on, so the next-ranked
    worker leaves that request to it (it took it before: the owner still looked full)."""
    a, b = await placing(redis, settings, "wa"), await placing(redis, settings, "wb")
    group = next(g for g in GROUPS if owner(g, ["wa", "wb"]) == "wa")
    await submit(redis, settings, [group])
    (d,) = await a.fetch(1, 10)
    assert await a.start(d) == "run"
    assert await dispatch(a, LANE, 0) == []  # a records no free slot
    await a.commit(d, FinalResult(status=State.DONE, output=RowOutput(text="t", num_output_tokens=1),
                                  usage=Usage(prompt_tokens=10, completion_tokens=1)))
    (after,) = await submit(redis, settings, [group])
    assert await dispatch(b, LANE, CAPACITY) == []  # not b's: its owner has a free slot
    assert [f["id"] for _, f in await dispatch(a, LANE, 1)] == [after.id]


async def test_a_dead_worker_moves_its_groups_and_only_them(redis: Redis, settings: Settings) -> None:
    workers = [await placing(redis, settings, n, live_ms=2_000) for n in ("wa", "wb", "wc")]
    before = {g: owner(g, ["wa", "wb", "wc"]) for g in GROUPS}
    assert "wa" in before.values()
    await redis.hset(SLOTS, "wa", f"{CAPACITY}|0")  # wa last seen long ago: dead
    after = {g: owner(g, ["wb", "wc"]) for g in GROUPS}
    assert {g for g in GROUPS if before[g] != after[g]} == {g for g in GROUPS if before[g] == "wa"}
    await submit(redis, settings, GROUPS)
    for c in workers[1:]:
        got = [group_of(f) for _, f in await dispatch(c, LANE, len(GROUPS))]
        assert got == [g for g in GROUPS if after[g] == c.consumer]  # wa's went to their next ranks at once
    # its heartbeat drops it from the slots hash, and the owners' recompute names the live only
    assert await workers[1].affinity.beat(LANE, "wb", CAPACITY) is not None
    assert not await redis.hexists(SLOTS, "wa")
    owners = await redis.hgetall(OWNERS)
    assert set(owners) == set(GROUPS) and all("wa" not in o.split(",") for o in owners.values())


async def test_the_owners_table_spreads_a_hot_group_within_the_bound(redis: Redis, settings: Settings) -> None:
    a, b = await placing(redis, settings, "wa"), await placing(redis, settings, "wb")
    hot = GROUPS[0]
    await submit(redis, settings, [hot] * 12 + GROUPS[1:3])
    owners = await a.affinity.beat(LANE, "wa", CAPACITY)
    assert owners is not None and set(owners[hot]) == {"wa", "wb"}  # 12 of 14 requests: over one worker's bound
    assert await b.affinity.beat(LANE, "wb", CAPACITY) is None  # one recompute per interval (the lock)
    got = {c.consumer: [group_of(f) for _, f in await dispatch(c, LANE, CAPACITY)] for c in (a, b)}
    assert got["wa"].count(hot) > 0 and got["wb"].count(hot) > 0  # both caches take the hot group


async def test_owners_keep_no_more_prompts_than_the_caches_their_heartbeats_report(redis: Redis,
                                                                                   settings: Settings) -> None:
    """admit.lua notes each group's prompt tokens; the recompute reads each live worker's cache
    size from its heartbeat and gives no worker more prompts than its cache keeps beside its
    running requests (a block each). Two caches of 7 blocks of 128 tokens, nothing running, and
    four groups of 3 full blocks (420 tokens), three of them ranked first by the same worker:
    the load bound alone would give it three, its cache keeps two."""
    a, _ = await placing(redis, settings, "wa"), await placing(redis, settings, "wb")
    for name in ("wa", "wb"):
        await redis.hset(WORKERS, name, json.dumps({"name": name, "in_flight": 0, "prefix_cache_blocks": 7,
                                                    "prefix_cache_block_size": 128}))
    ranked_a = [g for g in GROUPS if owner(g, ["wa", "wb"]) == "wa"]
    ranked_b = [g for g in GROUPS if owner(g, ["wa", "wb"]) == "wb"]
    groups = ranked_a[:3] + ranked_b[:1]
    await submit(redis, settings, groups, prefix_tokens=420)
    assert await redis.hgetall(f"{KEYS.tag}:aff:sizes") == dict.fromkeys(groups, "420")
    owners = await a.affinity.beat(LANE, "wa", CAPACITY)
    assert owners is not None and set(owners) == set(groups)
    assert Counter(o for owned in owners.values() for o in owned) == {"wa": 2, "wb": 2}
    # a group not requested lately keeps its owner (not its rank-1 worker) until its owner leaves
    moved = next(g for g in ranked_a[:3] if owners[g] == ["wb"])
    for _ in range(17):  # counts decayed below 0.25 (halved every 8): no group requested lately
        await redis.delete(f"{KEYS.tag}:aff:lock")
        assert await a.affinity.beat(LANE, "wa", CAPACITY) is not None
    assert not await redis.exists(f"{KEYS.tag}:aff:groups")
    assert (await redis.hgetall(OWNERS))[moved] == "wb"
    # by the load bound alone, wa would own its three (one in part)
    plain = bounded_owners(dict.fromkeys(groups, 1.0), ["wa", "wb"], BOUNDED_LOAD,
                           lambda g: rendezvous_ranks(g, ["wa", "wb"]))
    assert sum("wa" in owned for owned in plain.values()) == 3


async def test_the_doorbell_wakes_a_blocked_worker(redis: Redis, settings: Settings) -> None:
    a = await placing(redis, settings, "wa")
    await placing(redis, settings, "wb")
    mine = [g for g in GROUPS if owner(g, ["wa", "wb"]) == "wa"][0]
    waiting = asyncio.ensure_future(a.fetch(CAPACITY, block_ms=60_000))
    await asyncio.sleep(0.05)  # blocked on the doorbell
    assert not waiting.done()
    sent = await submit(redis, settings, [mine])
    got = await asyncio.wait_for(waiting, 30)  # woken by the admission, not by the 60 s block
    assert [d.message.id for d in got] == [sent[0].id]


async def test_a_dead_letter_retried_wakes_a_blocked_worker(redis: Redis, settings: Settings) -> None:
    """`sluice dlq retry` puts the request straight onto the lane: a placing worker, blocked on
    the doorbell rather than the lane, is woken by the retry (it waited out its poll before)."""
    a = await placing(redis, settings, "wa")
    await placing(redis, settings, "wb")
    m = message()
    await bury(redis, m)
    waiting = asyncio.ensure_future(a.fetch(CAPACITY, block_ms=60_000))
    await asyncio.sleep(0.05)  # blocked on the doorbell
    assert not waiting.done()
    assert await DeadLetters(redis, MODEL).retry(None, max_queued=10) == [m.id]
    got = await asyncio.wait_for(waiting, 30)  # woken by the retry, not by the 60 s block
    assert [d.message.id for d in got] == [m.id]


async def test_off_nothing_of_it_is_written_and_the_pull_is_fifo(redis: Redis, settings: Settings) -> None:
    c = await ready_consumer(redis, settings, "wa")
    # not placing: the deployment's prefix_affinity false
    c.configure(reserves=SlotReserves(capacity=CAPACITY), placement=PlacementRules())
    sent = await submit(redis, settings, GROUPS[:3])
    got = await c.fetch(CAPACITY, block_ms=10)
    assert [d.message.id for d in got] == [m.id for m in sent]
    assert await redis.keys(f"{KEYS.tag}:aff:*") == []
