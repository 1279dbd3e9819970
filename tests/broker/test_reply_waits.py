"""A reply follower's waits (broker/replies/shards.py Follower): one timer per quiet spell, not per
token, must still end a silent stream after its idle timeout, never a busy one, and find by its
rechecks a final whose stream expired while it waited."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from redis.asyncio import Redis

from sluice.broker.replies.router import LostFinal, ReplyRouter
from sluice.protocol.messages import DeltaEvent, FinalResult, RowOutput, State
from tests.broker.helpers import KEYS, MODEL


async def _delta(redis: Redis, rid: str, i: int) -> None:
    ev = DeltaEvent(i=i, text=f" t{i}", token_ids=[i])
    await redis.xadd(KEYS.reply(rid), {"kind": "delta", "data": ev.model_dump_json()})


def _final(text: str) -> str:
    return FinalResult(status=State.DONE, output=RowOutput(text=text, num_output_tokens=1)).model_dump_json()


async def test_a_busy_stream_outlives_its_idle_timeout(redis: Redis, make_router: Callable[..., ReplyRouter]) -> None:
    """The timer made when the stream first went quiet rings while tokens flow: it ends nothing."""
    router = make_router(shards=1, block_ms=1000, recheck_s=60)
    got: list[str] = []

    async def read() -> None:
        async for ev in router.follow(MODEL, "req-busy", idle_timeout_s=1.5):
            got.append(ev.delta.text if ev.delta else "final")

    reader = asyncio.create_task(read())
    for i in range(16):  # 4 s of tokens, 0.25 s apart: over two idle timeouts long
        await _delta(redis, "req-busy", i)
        await asyncio.sleep(0.25)
    await redis.xadd(KEYS.reply("req-busy"), {"kind": "final", "data": _final(" t")})
    await asyncio.wait_for(reader, 20)
    assert got == [f" t{i}" for i in range(16)] + ["final"]


async def test_a_quiet_follower_finds_a_final_whose_stream_expired(
        redis: Redis, make_router: Callable[..., ReplyRouter]) -> None:
    """Rechecks while the request runs end nothing; once its stream is gone and its status is
    final, the next recheck answers the final from the status."""
    router = make_router(shards=1, block_ms=1000, recheck_s=0.2)
    stream = router.follow(MODEL, "req-quiet")
    await _delta(redis, "req-quiet", 0)
    assert (await asyncio.wait_for(anext(stream), 20)).delta.text == " t0"
    nxt = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(1.0)  # several rechecks: the request is not final
    assert not nxt.done()
    await _delta(redis, "req-quiet", 1)
    assert (await asyncio.wait_for(nxt, 20)).delta.text == " t1"
    await redis.delete(KEYS.reply("req-quiet"))  # expired before its final was read
    await redis.hset(KEYS.status("req-quiet"), mapping={"state": "done", "result": _final(" t0 t1")})
    last = await asyncio.wait_for(anext(stream), 20)
    assert isinstance(last, LostFinal) and last.final.output.text == " t0 t1"
    await stream.aclose()
