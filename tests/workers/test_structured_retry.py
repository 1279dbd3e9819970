"""A retried structured-output request (issue 28, defect 2). A grammar cannot start mid-way, so
a structured row is generated again from token 0 on retry, and the tokens the earlier attempt
streamed are replayed. Whatever the chunkings of the two attempts and wherever the first one
stopped, an engine delta that straddles that point is split there: the stream stays contiguous,
equals the final text, and the commit goes through.

An engine may regenerate other tokens under another batch (the same seed or not): then the
request fails, with an error saying so, and nothing of the retry contradicts what was streamed
(its final has no text, and no token of it is written over or beside the streamed ones)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from sluice.broker.keys import ModelKeys
from sluice.broker.replies.writer import ReplyDecoder, ReplyWriter, delivered
from sluice.config.model import ModelConfig
from sluice.config.settings import Settings
from sluice.protocol.messages import DeltaEvent, FinalResult, SamplingSpec, StructuredSpec
from sluice.protocol.states import State
from sluice.workers.engines.base import Engine, GenerationRequest, TokenDelta
from sluice.workers.engines.null import NullEngine
from sluice.workers.generation import Generation, Running, final_result
from tests.broker.helpers import MODEL, admission, fetch_one, message, read_events, ready_consumer, take_over
from tests.workers import test_worker_delivery as through
from tests.workers.test_worker_null import eventually

N = 8  # tokens the row generates


def _chunks(sizes: tuple[int, ...], upto: int) -> list[list[int]]:
    """Token indices 0..upto-1 cut into deltas of the given sizes (cycled)."""
    out, at = [], 0
    for size in itertools.cycle(sizes):
        if at >= upto:
            return out
        out.append(list(range(at, min(at + size, upto))))
        at += size


def _text(tokens: list[int]) -> str:
    """Token id 100 + k is ' t<k>'; id 200 + k, another token at k, is ' u<k>'."""
    return "".join(f" t{t - 100}" if t < 200 else f" u{t - 200}" for t in tokens)


class ChunkedEngine(Engine):
    """Regenerates the same tokens (same seed) in the given chunking: token k is ' t<k>'. With
    `other_from`, tokens from that index on are others (' u<k>', ids 200 + k), as a real
    engine's may be under another batch; with `stop_at`, the row ends there ("stop"). Its text
    and token ids always agree, as a real engine's do."""

    def __init__(self, sizes: tuple[int, ...], other_from: int | None = None, stop_at: int | None = None) -> None:
        self.sizes, self.other_from, self.stop_at = sizes, other_from, stop_at
        self.closed: list[str] = []  # generations ended early (closed or cancelled by the worker)
        self.aborted: list[str] = []

    async def start(self) -> None: ...

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        assert request.resume_token_ids == []  # structured: from the start
        upto = min(request.max_tokens, self.stop_at if self.stop_at is not None else request.max_tokens)
        chunks = _chunks(self.sizes, upto)
        other_from = self.other_for(request)
        done = False
        try:
            for n, chunk in enumerate(chunks):
                ids = [(200 if other_from is not None and k >= other_from else 100) + k for k in chunk]
                last = n == len(chunks) - 1
                yield TokenDelta(text=_text(ids), token_ids=ids,
                                 finish_reason=("stop" if upto < request.max_tokens else "length") if last else None)
                await asyncio.sleep(0)  # rows side by side interleave
            done = True
        finally:
            if not done:
                self.closed.append(request.request_id)

    def other_for(self, request: GenerationRequest) -> int | None:
        return self.other_from

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

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


async def _first_attempt_streams(redis: Redis, settings: Settings, first: tuple[int, ...], streamed: int,
                                 rows: int = 1):
    """A structured request of `rows` rows of N tokens whose first attempt streamed `streamed`
    tokens of each row (chunked as `first`), then died; the second attempt has started. Returns
    (message, writer, the live consumer, its delivery)."""
    m = message(rows=rows).model_copy(update={
        "sampling": SamplingSpec(max_tokens=N, seed=7, structured=StructuredSpec(regex="( [tu][0-9])+"))})
    m.rows = [{"prompt": f"p{r}", "max_tokens": N} for r in range(rows)]
    await admission(redis, settings).submit(m, max_queued=1000)
    dead = await ready_consumer(redis, settings, "dead")
    d1 = await fetch_one(dead)
    assert await dead.start(d1) == "run"
    writer = ReplyWriter(redis, MODEL, reply_ttl_s=settings.reply_ttl_s)
    for row in range(rows):
        for chunk in _chunks(first, streamed):
            ids = [100 + k for k in chunk]
            writer.delta(d1, DeltaEvent(i=chunk[0], text=_text(ids), token_ids=ids, row=row))
    await writer.flush()
    live, d2 = await take_over(redis, settings, d1, "live")
    return m, writer, live, d2


async def _read(redis: Redis, rid: str) -> tuple[dict[int, str], list[FinalResult]]:
    """What a reader from the start gets: per row the text of its deltas, and the finals."""
    decoder, texts, finals = ReplyDecoder(), {}, []
    for entry_id, fields in await redis.xrange(ModelKeys(MODEL).reply(rid)):
        if (ev := decoder.event(entry_id, fields)) is None:
            continue
        if ev.kind == "final":
            finals.append(ev.final)
        else:
            texts[ev.delta.row] = texts.get(ev.delta.row, "") + ev.delta.text
    return texts, finals


def _failed_as_diverged(final: FinalResult) -> None:
    assert final.status is State.FAILED, final
    assert "diverged from the tokens already streamed" in final.error and "resubmit" in final.error, final.error
    assert final.output is None and final.rows is None, final


@pytest.mark.parametrize("again", [(1,), (3,), (2, 3), (8,)], ids=str)
async def test_a_retry_that_regenerates_other_tokens_fails_without_contradicting_the_stream(
        redis: Redis, settings: Settings, again: tuple[int, ...]) -> None:
    """Wherever the first attempt stopped and wherever the retry's tokens turn other (inside the
    streamed part: a divergence; past it: new tokens, fine), however both are chunked: the
    request ends once, failed with the reason when it diverged, and a reader from the start gets
    the stream's tokens, never the retry's others, and a final without text; otherwise done,
    with the stream equal to the final."""
    first = (2, 5)
    for streamed in range(1, N):
        for other_from in range(streamed + 1):  # past the stream's end: the same as at it
            why = (streamed, other_from, again)
            m, writer, live, d2 = await _first_attempt_streams(redis, settings, first, streamed)
            run = Running.start(d2)
            engine = ChunkedEngine(again, other_from=other_from)
            outputs = await Generation(engine, writer).rows(run, await delivered(redis, MODEL, m.id))
            final = final_result(run, outputs, None)
            assert await writer.commit(d2, final, live.commit), why
            texts, finals = await _read(redis, m.id)
            assert finals == [final], why
            row = (await delivered(redis, MODEL, m.id))[0]
            if other_from < streamed:
                _failed_as_diverged(final)
                assert f"token {other_from} of {streamed}" in final.error, why
                assert texts == {0: _text(list(range(100, 100 + streamed)))}, why  # only what was streamed
                assert row.token_ids == list(range(100, 100 + streamed)), why
                assert engine.closed or engine.aborted, why  # the generation was stopped
            else:
                assert final.status is State.DONE, why
                assert texts[0] == final.output.text == "".join(row.text), why
                assert row.token_ids[:streamed] == list(range(100, 100 + streamed)), why


@pytest.mark.parametrize("again", [(1,), (3,), (8,)], ids=str)
async def test_a_retry_that_ends_before_the_streamed_tokens_fails(
        redis: Redis, settings: Settings, again: tuple[int, ...]) -> None:
    """The same tokens, but fewer than the stream holds ("stop" earlier): the stream holds more
    than the final could say, so the request fails and nothing is written to the stream."""
    for streamed in range(2, N):
        for stop_at in range(1, streamed):
            m, writer, live, d2 = await _first_attempt_streams(redis, settings, (1,), streamed)
            run = Running.start(d2)
            outputs = await Generation(ChunkedEngine(again, stop_at=stop_at), writer).rows(
                run, await delivered(redis, MODEL, m.id))
            final = final_result(run, outputs, None)
            assert await writer.commit(d2, final, live.commit)
            _failed_as_diverged(final)
            texts, finals = await _read(redis, m.id)
            assert (texts, finals) == ({0: _text(list(range(100, 100 + streamed)))}, [final]), (streamed, stop_at)


async def test_a_retry_stopped_before_regenerating_the_streamed_tokens_ends_with_them(
        redis: Redis, settings: Settings) -> None:
    """Cancelled while the retry regenerates (the same tokens) what the stream holds: the final
    (cancelled) says the streamed text, not the shorter part regenerated by then."""

    class Aborted(ChunkedEngine):
        abort_at = 0

        async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
            async for delta in super().generate(request):
                if delta.token_ids[-1] - 100 >= self.abort_at:
                    yield TokenDelta(text="", token_ids=[], finish_reason="abort")
                    return
                yield delta

    for abort_at in range(5):
        m, writer, live, d2 = await _first_attempt_streams(redis, settings, (1,), 5)
        run = Running.start(d2)
        run.stop_reason = State.CANCELLED
        engine = Aborted((1,))
        engine.abort_at = abort_at
        outputs = await Generation(engine, writer).rows(run, await delivered(redis, MODEL, m.id))
        final = final_result(run, outputs, None)
        assert await writer.commit(d2, final, live.commit)
        texts, finals = await _read(redis, m.id)
        assert (final.status, final.output.text, final.output.num_output_tokens) == (
            State.CANCELLED, _text(list(range(100, 105))), 5), abort_at
        assert (texts, finals) == ({0: final.output.text}, [final]), abort_at


async def test_one_diverging_row_fails_the_request_and_stops_its_other_rows(
        redis: Redis, settings: Settings) -> None:
    """Row 0 regenerates other tokens, row 1 the same: the request fails as one, row 1's
    generation is stopped too, and each row's stream holds only tokens that agree with it."""

    class RowZeroOther(ChunkedEngine):
        def other_for(self, request: GenerationRequest) -> int | None:
            return 1 if request.request_id.endswith(":0") else None

    m, writer, live, d2 = await _first_attempt_streams(redis, settings, (1,), 3, rows=2)
    run = Running.start(d2)
    engine = RowZeroOther((1,))
    outputs = await Generation(engine, writer).rows(run, await delivered(redis, MODEL, m.id))
    final = final_result(run, outputs, None)
    assert await writer.commit(d2, final, live.commit)
    _failed_as_diverged(final)
    texts, finals = await _read(redis, m.id)
    assert finals == [final]
    assert texts[0] == _text([100, 101, 102])
    assert _text(list(range(100, 100 + N))).startswith(texts[1])  # row 1 agreed: whatever it wrote is its own
    assert f"{m.id}:1" in engine.closed + engine.aborted  # stopped, not left generating


async def test_the_null_engine_gives_other_token_ids_when_it_gives_other_tokens() -> None:
    """As strict as a real engine: under batch-dependent tokens (composition), a token whose text
    differs with the batch has another id too, so a regenerated structured row that differs
    is seen by its ids."""
    engine = NullEngine(composition=True)

    async def ids_and_text(request_id: str) -> tuple[list[int], str]:
        got = [d async for d in engine.generate(GenerationRequest(request_id=request_id, prompt="p", max_tokens=3))]
        return [t for d in got for t in d.token_ids], "".join(d.text for d in got)

    alone = await ids_and_text("a")
    engine._running.add("other")  # another request in the batch
    beside = await ids_and_text("b")
    assert alone[1] != beside[1] and alone[0] != beside[0], (alone, beside)
    assert await ids_and_text("c") == beside and NullEngine().composition is False


async def test_a_worker_fails_a_structured_retry_its_engine_regenerates_otherwise(
        redis: Redis, settings: Settings) -> None:
    """Through a worker and the null engine whose tokens depend on the batch (their text and
    ids): the first attempt streamed ' t0.9 t1.9' (nine in its batch) and died; the retry,
    alone in the engine, regenerates ' t0.1' first. The request ends once, failed, saying why,
    and a reader gets the streamed text and that final, nothing of the retry."""
    settings = settings.model_copy(update={"lease_timeout_s": 1.0, "heartbeat_interval_s": 0.2})
    m = through.message(5)
    m.sampling.structured = StructuredSpec(json_object=True)
    await admission(redis, settings).submit(m, max_queued=10)
    await through.died_after_streaming(redis, settings, DeltaEvent(i=0, text=" t0.9 t1.9", token_ids=[9, 1009]))
    started: list = []
    try:
        await through.start(redis, settings, started, NullEngine(token_delay_s=0.005, composition=True),
                            ModelConfig(name=MODEL, dynamic_batching_config=through.DYNAMIC))
        await eventually(lambda: through.is_final(redis, m.id), timeout_s=30, what="final")
    finally:
        for worker, _ in started:
            worker.stopping.set()
        await asyncio.wait_for(asyncio.gather(*(t for _, t in started), return_exceptions=True), 30)
    final = await through.final_of(redis, m.id)
    _failed_as_diverged(final)
    assert "token 0 of 2" in final.error, final.error
    events = await read_events(redis, m.id, idle_timeout_s=5)
    assert "".join(e.delta.text for e in events if e.kind == "delta") == " t0.9 t1.9"
    assert [e.final for e in events if e.kind == "final"] == [final]
