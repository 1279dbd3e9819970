"""The two suspected TTL defects of issue 28, confirmed (both failed on the code before the
fix) and fixed: an unfinished reply stream always lives as long as its status, and no writer
ever creates a key without a TTL."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from sluice.broker.replies.writer import ReplyWriter
from sluice.config.settings import Settings
from sluice.protocol.messages import DeltaEvent
from tests.broker.helpers import KEYS, MODEL, done_result, running_request
from tests.conftest import TOPOLOGY


def _writer(redis: Redis, settings: Settings) -> ReplyWriter:
    # as the worker makes it: an unfinished request's stream lives as long as its status
    return ReplyWriter(redis, MODEL, reply_ttl_s=settings.status_ttl_s)


async def test_a_refused_commit_keeps_the_unfinished_streams_ttl(redis: Redis, settings: Settings) -> None:
    """Confirmed: a commit refused (the stream short of the tokens sent) set the stream's TTL to
    the short after-final one (reply_ttl_s, 60 s). A successor starting later than that found
    no stream, regenerated from index 0, and its final could differ from what was streamed."""
    assert settings.reply_ttl_s < settings.status_ttl_s // 2
    _, m, c, d = await running_request(redis, settings)
    writer = _writer(redis, settings)
    writer.delta(d, DeltaEvent(i=0, text=" a", token_ids=[0]))
    await writer.flush()
    refused = await c.commit(d, done_result(" a b c d e"), streamed=[5])  # 4 tokens short
    assert refused == [0, 1]
    assert await redis.ttl(KEYS.reply(m.id)) > settings.status_ttl_s // 2
    assert await redis.hget(KEYS.status(m.id), "state") == "running"


async def test_a_writer_that_finds_the_status_gone_creates_no_key_without_a_ttl(
        redis: Redis, settings: Settings) -> None:
    """Confirmed: with the status hash and the reply stream gone (expired, or lost), a later
    flush (the stream's TTL set already by the attempt's first write) re-created the stream
    without a TTL, a key that never expired. Now the writer is fenced: no status, no fence."""
    _, m, c, d = await running_request(redis, settings)
    writer = _writer(redis, settings)
    writer.delta(d, DeltaEvent(i=0, text=" a", token_ids=[0]))
    await writer.flush()
    await redis.delete(KEYS.status(m.id), KEYS.reply(m.id))
    writer.delta(d, DeltaEvent(i=1, text=" b", token_ids=[1]))
    await writer.flush()
    assert await c.commit(d, done_result(" a b"), deltas=[]) is False
    for key in (KEYS.reply(m.id), KEYS.status(m.id)):
        assert await redis.ttl(key) != -1, key  # -2: not there at all


@pytest.mark.skipif(TOPOLOGY != "single", reason="DUMP/RESTORE stands in for a failover")
@pytest.mark.parametrize("snapshot_after", [0, 1, 2])
@pytest.mark.parametrize("written", [1, 3])
async def test_a_later_write_that_re_creates_a_lost_stream_gives_it_a_ttl(
        redis: Redis, settings: Settings, snapshot_after: int, written: int) -> None:
    """The simulation's replay: a failover loses the reply stream (the replica's snapshot has
    the status as it was after `snapshot_after` tokens); the same attempt's next write
    (its first set the TTL already) re-creates the stream, which had no TTL, never expiring."""
    _, m, c, d = await running_request(redis, settings)
    writer = _writer(redis, settings)
    saved = None
    for i in range(written):
        if i == snapshot_after:
            saved = await redis.dump(KEYS.status(m.id))
        writer.delta(d, DeltaEvent(i=i, text=f" t{i}", token_ids=[i]))
        await writer.flush()
    saved = saved or await redis.dump(KEYS.status(m.id))
    await redis.delete(KEYS.reply(m.id))  # the failover: the stream lost, the status as saved
    await redis.restore(KEYS.status(m.id), settings.status_ttl_s * 1000, saved, replace=True)
    writer.delta(d, DeltaEvent(i=written, text=f" t{written}", token_ids=[written]))
    await writer.flush()
    assert await redis.xlen(KEYS.reply(m.id)) > 0
    assert await redis.ttl(KEYS.reply(m.id)) > settings.status_ttl_s // 2
