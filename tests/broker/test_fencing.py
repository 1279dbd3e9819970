"""Fencing (issue 28, defect 4): every start takes a fresh fencing token, and only the writer
holding the status's current token writes tokens or a final. Two workers on the same attempt
(a failover lost worker A's read and start, so the entry was delivered fresh to worker B) are
told apart: whatever the order of their writes and commits, the stream holds B's tokens only
and B's text is the one final."""

from __future__ import annotations

import itertools
import json

import pytest
from redis.asyncio import Redis

from sluice.broker.replies.writer import ReplyWriter, delivered
from sluice.config.settings import Settings
from sluice.protocol.messages import DeltaEvent
from tests.broker.helpers import KEYS, MODEL, admission, done_result, fetch_one, ready_consumer, submit_n
from tests.conftest import TOPOLOGY

pytestmark = pytest.mark.skipif(TOPOLOGY != "single", reason="DUMP/RESTORE stands in for a failover")


def _orders() -> list[tuple[str, ...]]:
    """Every interleaving of A's steps (write, commit) with B's (write, commit)."""
    steps = ["A.write", "A.commit", "B.write", "B.commit"]
    return [p for p in itertools.permutations(steps)
            if p.index("A.write") < p.index("A.commit") and p.index("B.write") < p.index("B.commit")]


@pytest.mark.parametrize("order", _orders(), ids=lambda o: "-".join(o))
async def test_two_workers_on_the_same_attempt_are_fenced(redis: Redis, settings: Settings, order) -> None:
    adm = admission(redis, settings)
    (m,) = await submit_n(adm, 1)
    saved = {key: await redis.dump(key) for key in (KEYS.requests, KEYS.status(m.id))}
    a = await ready_consumer(redis, settings, "a")
    da = await fetch_one(a)
    assert await a.start(da) == "run"
    for key, value in saved.items():  # a failover loses A's read and its start
        await redis.restore(key, 0, value, replace=True)
    await redis.expire(KEYS.status(m.id), settings.status_ttl_s)
    b = await ready_consumer(redis, settings, "b")
    db = await fetch_one(b)
    assert (db.entry_id, db.attempt) == (da.entry_id, da.attempt) == (da.entry_id, 1)
    assert await b.start(db) == "run"
    writers = {"A": (a, da, ReplyWriter(redis, MODEL, reply_ttl_s=settings.reply_ttl_s), " a"),
               "B": (b, db, ReplyWriter(redis, MODEL, reply_ttl_s=settings.reply_ttl_s), " b")}
    committed = {}
    for step in order:
        who, what = step.split(".")
        c, d, writer, word = writers[who]
        if what == "write":
            for i in range(2):
                writer.delta(d, DeltaEvent(i=i, text=f"{word}{i}", token_ids=[i]))
            await writer.flush()
        else:
            committed[who] = await writer.commit(d, done_result(f"{word}0{word}1"), c.commit)
    assert committed == {"A": False, "B": True}
    row = (await delivered(redis, MODEL, m.id))[0]
    assert "".join(row.text) == " b0 b1"
    result = json.loads(await redis.hget(KEYS.status(m.id), "result"))
    assert result["output"]["text"] == " b0 b1"
    assert await redis.xlen(KEYS.requests) == 0  # B's commit acknowledged and deleted the entry
