"""The promise, checked against Redis and the readers after every step and at the end."""

from __future__ import annotations

import asyncio
import json
import time

from sluice.protocol.messages import DeltaEvent, FinalResult
from sluice.protocol.states import FINAL_STATES
from tests.sim.world import KEYS, Violation, World

BOUNDED = {KEYS.requests, KEYS.bulk, KEYS.dead_letters, KEYS.log}  # capped or drained, no TTL
FINALS = {s.value for s in FINAL_STATES}


def texts(final: FinalResult) -> list[str]:
    return [o.text for o in (final.rows or ([final.output] if final.output else []))]


def stream_rows(rid: str, entries: list) -> dict[int, str]:
    """Each row's text as a reader from index 0 joins it (an overlap repeats tokens held already:
    skipped); a hole is a broken promise."""
    rows: dict[int, list[str]] = {}
    seen: dict[int, int] = {}
    for entry_id, f in entries:
        if f.get("kind") != "delta":
            continue
        d = DeltaEvent.model_validate_json(f["data"])
        at = seen.get(d.row, 0)
        if d.i > at:
            raise Violation("the stream has no hole", f"{rid} row {d.row}: entry {entry_id} starts at {d.i}, "
                                                      f"the stream holds {at} tokens")
        if d.i + len(d.token_ids) <= at:
            continue
        if d.i < at:
            raise Violation("the stream has no hole", f"{rid} row {d.row}: entry {entry_id} straddles {at}")
        rows.setdefault(d.row, []).append(d.text)
        seen[d.row] = d.i + len(d.token_ids)
    return {row: "".join(t) for row, t in rows.items()}


async def check_step(world: World) -> None:
    for r in world.readers:
        if r.gaps and not r.tainted:
            raise Violation("a reader's indices are contiguous", f"reader {r.idx} of {r.rid}: {r.gaps[0]}")
    for w in world.workers:  # what a worker holds (and leases) is in its hands: fetched, running or parked
        handed = {d.key for d in w.fetched} | {run.d.key for run in w.runs.values()}
        handed |= {d.key for d in getattr(getattr(w.consumer, "quarantine", None), "parked", ())}
        if limbo := set(w.consumer.held) - handed:
            raise Violation("no orphan", f"worker {w.name} holds (and leases) entries it never handed out: "
                                         f"{sorted(e for _, e in limbo)}")
    redis, ledger = world.redis, world.ledger
    keys = [k async for k in redis.scan_iter("*")]
    async with redis.pipeline(transaction=False) as pipe:
        for k in keys:
            pipe.ttl(k)
        ttls = await pipe.execute()
    forever = [k for k, ttl in zip(keys, ttls) if ttl == -1 and k not in BOUNDED]
    if forever:
        raise Violation("every key expires", f"no TTL on {forever}")
    rids = list(ledger.accepted)
    async with redis.pipeline(transaction=False) as pipe:
        for rid in rids:
            pipe.hgetall(KEYS.status(rid))
            pipe.xrange(KEYS.reply(rid))
        got = await pipe.execute()
    messages = {r.message.id: r.message for r in world.requests}
    for rid, status, entries in zip(rids, got[::2], got[1::2]):
        await _check_request(world, rid, messages[rid], status, entries)


async def _check_request(world: World, rid: str, message, status: dict, entries: list) -> None:
    ledger = world.ledger
    finals = [FinalResult.model_validate_json(f["data"]) for _, f in entries if f.get("kind") == "final"]
    if len(finals) > 1:
        raise Violation("one final", f"{rid}: {len(finals)} finals on its reply stream")
    if not status:
        if rid not in ledger.expired:
            raise Violation("no orphan", f"{rid}: accepted, and its status is gone before its TTL")
        return
    state, result = status.get("state"), status.get("result")
    final = state in FINALS
    if final != (result is not None) or (result and json.loads(result)["status"] != state):
        raise Violation("the status agrees with the final", f"{rid}: state {state}, result {result}")
    if finals and (not final or finals[0].status.value != state):
        raise Violation("the status agrees with the final", f"{rid}: stream final {finals[0].status}, state {state}")
    if not final or rid not in ledger.expired:
        kept = {"model": message.model, "lane": message.lane, "owner": message.owner}
        lost = {k: (v, status.get(k)) for k, v in kept.items() if v is not None and status.get(k) != v}
        if lost or "retain_s" not in status:
            raise Violation("the status keeps what admission wrote", f"{rid} ({state}): {lost or 'no retain_s'}")
    seen = ledger.finals.get(rid)
    if final:
        now = {"state": state, "result": result}
        if seen is not None and seen != now:
            raise Violation("a final never changes", f"{rid}: {seen['state']} became {state}")
        ledger.finals[rid] = now
        if finals and state == "done":
            rows = stream_rows(rid, entries)
            want = texts(finals[0])
            for row, text in enumerate(want):
                if rows.get(row, "") != text:
                    raise Violation("the stream holds the final text",
                                    f"{rid} row {row}: streamed {rows.get(row, '')!r}, final {text!r}")
        return
    if seen is not None:
        raise Violation("a final never changes", f"{rid}: {seen['state']} became {state}")
    entry, stream = status.get("entry"), status.get("stream")
    if not entry or not stream or not await world.redis.xrange(stream, entry, entry):
        raise Violation("no orphan", f"{rid} ({state}): its entry {entry} is not on {stream}")


async def check_end(world: World, timeout_s: float = 60.0) -> None:
    """After the drain: every accepted request is final (or expired), and every reader of one
    got its final and, unless told its stream expired, the final text."""
    await check_step(world)
    for rid in world.ledger.accepted:
        status = await world.redis.hgetall(KEYS.status(rid))
        if rid not in world.ledger.expired and status.get("state") not in FINALS:
            raise Violation("every accepted request ends", f"{rid}: {status.get('state')} after the drain")
    readers = [r for r in world.readers if r.rid in world.ledger.accepted and r.rid not in world.ledger.expired]
    deadline = time.monotonic() + timeout_s
    while any(r.live for r in readers) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    for r in readers:
        if r.live:
            raise Violation("every reader ends", f"reader {r.idx} of {r.rid}: no final after {timeout_s:g}s")
        if r.task is not None and r.task.exception() is not None:
            raise Violation("every reader ends", f"reader {r.idx} of {r.rid}: {r.task.exception()!r}")
        if r.final is None:
            raise Violation("every reader ends", f"reader {r.idx} of {r.rid}: ended without a final")
        if r.tainted:
            continue
        seen = world.ledger.finals.get(r.rid)
        if seen is not None and r.final.status.value != seen["state"]:
            raise Violation("a reader's final is the final", f"reader {r.idx} of {r.rid}: {r.final.status.value}, "
                                                             f"status {seen['state']}")
        for row, text in enumerate(texts(r.final)):
            got = "".join(r.rows.get(row, []))
            if got != text and not (r.lost and text.startswith(got)):
                raise Violation("a reader's text is the final text",
                                f"reader {r.idx} of {r.rid} row {row}: read {got!r}, final {text!r}"
                                + (" (told the stream expired)" if r.lost else ""))
