"""A retried structured-output request (issue 28, defect 2). A grammar cannot start mid-way, so
a structured row is generated again from token 0 on retry, and the tokens the earlier attempt
streamed are replayed. Whatever the chunkings of the two attempts and wherever the first one
stopped, an engine delta that straddles that point is split there: the stream stays contiguous,
equals the final text, and the commit goes through."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from sluice.broker.replies import ReplyWriter, delivered
from sluice.config.settings import Settings
from sluice.protocol.messages import DeltaEvent, SamplingSpec, StructuredSpec
from sluice.workers.engines.base import Engine, GenerationRequest, TokenDelta
from sluice.workers.generation import Generation, Running, final_result
from tests.broker.helpers import MODEL, admission, fetch_one, message, ready_consumer, take_over

N = 8  # tokens the row generates


def _chunks(sizes: tuple[int, ...], upto: int) -> list[list[int]]:
    """Token indices 0..upto-1 cut into deltas of the given sizes (cycled)."""
    out, at = [], 0
    for size in itertools.cycle(sizes):
        if at >= upto:
            return out
        out.append(list(range(at, min(at + size, upto))))
        at += size


class ChunkedEngine(Engine):
    """Regenerates the same tokens (same seed) in the given chunking: token k is ' t<k>'."""

    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.sizes = sizes

    async def start(self) -> None: ...

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        assert request.resume_token_ids == []  # structured: from the start
        chunks = _chunks(self.sizes, request.max_tokens)
        for n, chunk in enumerate(chunks):
            yield TokenDelta(text="".join(f" t{k}" for k in chunk), token_ids=[100 + k for k in chunk],
                             finish_reason="length" if n == len(chunks) - 1 else None)

    async def abort(self, request_id: str) -> None: ...

    async def shutdown(self) -> None: ...


CHUNKINGS = [(1,), (2,), (3,), (5,), (8,), (2, 3), (3, 1, 4)]


@pytest.mark.parametrize("first", [(1,), (3,), (2, 5)], ids=str)
@pytest.mark.parametrize("again", CHUNKINGS, ids=str)
async def test_a_retried_structured_row_streams_what_its_final_says(
        redis: Redis, settings: Settings, first: tuple[int, ...], again: tuple[int, ...]) -> None:
    for streamed in range(1, N):  # where the first attempt stopped
        m = message().model_copy(update={
            "rows": [{"prompt": "p", "max_tokens": N}],
            "sampling": SamplingSpec(max_tokens=N, seed=7, structured=StructuredSpec(regex="( t[0-9])+"))})
        await admission(redis, settings).submit(m, max_queued=1000)
        dead = await ready_consumer(redis, settings, "dead")
        d1 = await fetch_one(dead)
        assert await dead.start(d1) == "run"
        writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.reply_ttl_s)
        for chunk in _chunks(first, streamed):  # the first attempt streams, then its worker dies
            writer.delta(d1, DeltaEvent(i=chunk[0], text="".join(f" t{k}" for k in chunk),
                                        token_ids=[100 + k for k in chunk]))
        await writer.flush()
        live, d2 = await take_over(redis, settings, d1, "live")
        run = Running.start(d2)
        outputs = await Generation(ChunkedEngine(again), writer).rows(run, await delivered(redis, MODEL, m.id))
        final = final_result(run, outputs, None)
        assert await writer.commit(d2, final, live.commit), (streamed, first, again)
        row = (await delivered(redis, MODEL, m.id))[0]
        expected = "".join(f" t{k}" for k in range(N))
        assert (final.output.text, "".join(row.text), row.token_ids) == (
            expected, expected, [100 + k for k in range(N)]), (streamed, first, again)
