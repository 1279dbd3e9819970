"""One request on the engine: its rows generated side by side, each token delta written to its
reply channel as it comes, and the final result assembled from what came back.

A redelivered request continues after the tokens its reply stream already holds (prompt plus
delivered token ids, the remaining `max_tokens`): what was streamed and the final text then
agree by construction. A structured row cannot continue (a grammar starts at token 0): it is
generated again, and must regenerate the very tokens its stream holds; if the engine gives
others (its tokens may change with the batch), the request fails rather than contradict what
its clients streamed (see Diverged).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from sluice.broker.delivery.consumer import Delivery
from sluice.broker.replies.writer import Delivered, ReplyWriter
from sluice.protocol.messages import DeltaEvent, FinalResult, RowOutput, Timings, TokenLogprob, Usage
from sluice.protocol.states import State
from sluice.workers.engines.base import Engine, GenerationRequest, TokenDelta

log = logging.getLogger(__name__)


# SamplingSpec fields a GenerationRequest takes as they are (the others depend on the row and
# on what an earlier attempt delivered); its sampling (Sampled's fields) travels as one object.
_AS_SAMPLED = ("logprobs", "structured")


@dataclass
class Running:
    """A request the engine is working on."""

    delivery: Delivery
    started: float
    engine_ids: list[str]  # one per row: what the engine aborts
    first_token: float | None = None
    prompt_tokens: int = 0
    stop_reason: State | None = None  # CANCELLED / EXPIRED once aborted for that reason
    fenced: bool = False  # its lease lapsed and another worker may reclaim it: finish quietly, commit nothing
    failure: str | None = None  # why it cannot end with an output (see Diverged): it fails with this error

    @classmethod
    def start(cls, delivery: Delivery) -> Running:
        rid, n_rows = delivery.message.id, len(delivery.message.rows)
        return cls(delivery, time.time(), [rid] if n_rows == 1 else [f"{rid}:{i}" for i in range(n_rows)])


@dataclass
class RowResult:
    """One row's output so far: what an earlier attempt delivered, then this attempt's deltas."""

    text: list[str] = field(default_factory=list)
    tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    replayed_ids: list[int] = field(default_factory=list)  # the tokens a regenerated row's stream holds
    replayed_text: str = ""  # their text, as the reply stream holds it

    @property
    def replayed(self) -> int:
        return len(self.replayed_ids)


class Diverged(Exception):
    """A retried structured row, generated again from token 0, gave other tokens than its reply
    stream holds (an engine's tokens may change with the batch, even under the same seed). The
    row cannot go on consistently: continuing would stream one text and commit another."""


class Generation:
    def __init__(self, engine: Engine, replies: ReplyWriter, on_gap: Callable[[float], None] | None = None):
        self.engine = engine
        self.replies = replies
        self.on_gap = on_gap  # told the time per token between a row's deltas (the worker's pace)

    async def rows(self, run: Running, resume: dict[int, Delivered]) -> list[RowOutput]:
        """Every row of the request, resumed after what `resume` says was delivered."""
        n_rows = len(run.delivery.message.rows)
        tasks = [asyncio.ensure_future(self._row(run, i, resume.get(i))) for i in range(n_rows)]
        try:
            return list(await asyncio.gather(*tasks))
        except Diverged as err:
            # The request fails (final_result): its other rows are stopped, and it has no output,
            # so its final holds no text beside what its clients streamed.
            log.warning("request %s: %s", run.delivery.message.id, err)
            run.failure = ("retry of a structured-output request diverged from the tokens already streamed "
                           f"({err}); resubmit")
            await self.abort(run)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return []

    async def _row(self, run: Running, row: int, before: Delivered | None) -> RowOutput:
        msg = run.delivery.message
        values = msg.rows[row]
        s = msg.sampling
        before = held = before or Delivered()
        if s.structured is not None and before.finish is None:
            # A grammar cannot start mid-way: a structured row is generated again from its start
            # (same seed), and readers skip the tokens they already have (by index).
            replayed, replayed_text = before.token_ids, "".join(before.text)
            before = Delivered(prompt_logprobs=before.prompt_logprobs)
        else:
            replayed, replayed_text = [], ""
        max_tokens = int(values.get("max_tokens") or s.max_tokens)
        result = RowResult(text=list(before.text), tokens=len(before.token_ids), finish_reason=before.finish,
                           logprobs=list(before.logprobs), prompt_logprobs=before.prompt_logprobs,
                           replayed_ids=replayed, replayed_text=replayed_text)
        if result.finish_reason is None and result.tokens >= max_tokens:
            result.finish_reason = "length"
        if result.finish_reason is None:
            await self._stream(run, row, result, GenerationRequest(
                request_id=run.engine_ids[row],
                prompt=self.engine.prompt_for(values),
                **{name: getattr(s, name) for name in _AS_SAMPLED},
                max_tokens=max_tokens - result.tokens,
                seed=s.seed + row,
                sampling=s.sampled(min_tokens=max(0, s.min_tokens - result.tokens)),
                # Asked once: a resumed attempt's prompt holds the delivered tokens too.
                prompt_logprobs=s.prompt_logprobs if result.prompt_logprobs is None else None,
                priority=msg.priority,
                resume_token_ids=before.token_ids,
            ))
        if result.tokens < result.replayed:
            # Stopped (a cancel, the deadline) before regenerating what the stream holds: that part
            # agreed so far (_check_replayed), and the row's output is what its clients streamed.
            result.text, result.tokens = list(held.text), len(held.token_ids)
            result.logprobs = list(held.logprobs)
        text = "".join(result.text)
        extra = self.engine.extra_outputs(values, text, result.tokens)
        run.prompt_tokens += result.prompt_tokens
        calls, content = _tool_calls(self.engine, values, text)
        return RowOutput(text=text, num_output_tokens=result.tokens, finish_reason=result.finish_reason,
                         fields=extra or None, logprobs=result.logprobs if s.logprobs is not None else None,
                         prompt_logprobs=result.prompt_logprobs, tool_calls=calls, tool_content=content)

    async def _stream(self, run: Running, row: int, result: RowResult, request: GenerationRequest) -> None:
        last: float | None = None
        # Closed on leaving (a divergence): the engine stops the generation there.
        async with aclosing(self.engine.generate(request)) as deltas:
            async for delta in deltas:
                if delta.token_ids and self.on_gap is not None:
                    now = time.monotonic()
                    if last is not None:
                        self.on_gap((now - last) / len(delta.token_ids))
                    last = now
                if delta.prompt_tokens is not None:
                    result.prompt_tokens = delta.prompt_tokens
                # An abort is not a finish: the stop reason (cancel, deadline) says why it ended.
                finish = delta.finish_reason if delta.finish_reason != "abort" else None
                if delta.token_ids or finish:
                    if run.first_token is None and delta.token_ids:
                        run.first_token = time.time()
                    _check_replayed(result, delta, finish)
                    # Written where it is not on the stream yet (or ends the row):
                    if result.tokens + len(delta.token_ids) > result.replayed or finish:
                        self.replies.delta(run.delivery,
                                           _past_replayed(result, delta, row, run.delivery.attempt, finish))
                    result.text.append(delta.text)
                    result.tokens += len(delta.token_ids)
                    result.logprobs.extend(delta.logprobs or ())
                    if delta.prompt_logprobs is not None:
                        result.prompt_logprobs = delta.prompt_logprobs
                if delta.finish_reason is not None:
                    result.finish_reason = delta.finish_reason

    async def abort(self, run: Running) -> None:
        for eid in run.engine_ids:
            await self.engine.abort(eid)


def _check_replayed(result: RowResult, delta: TokenDelta, finish: str | None) -> None:
    """Raise Diverged unless the part of a regenerated row's delta that its reply stream holds
    already is the very tokens the stream holds (compared by id), and unless the row, finishing,
    reached the stream's end: nothing of this attempt may contradict what was streamed."""
    held = result.replayed_ids[result.tokens:result.tokens + len(delta.token_ids)]
    if held != delta.token_ids[:len(held)]:
        at = result.tokens + next(k for k, (a, b) in enumerate(zip(held, delta.token_ids)) if a != b)
        raise Diverged(f"token {at} of {result.replayed} streamed was regenerated as another token")
    if finish is not None and result.tokens + len(delta.token_ids) < result.replayed:
        raise Diverged(f"the regeneration ended at token {result.tokens + len(delta.token_ids)} "
                       f"of {result.replayed} streamed")


def _past_replayed(result: RowResult, delta: TokenDelta, row: int, attempt: int,
                   finish: str | None) -> DeltaEvent:
    """The part of an engine delta the reply stream does not hold yet. A regenerated structured
    row replays the tokens an earlier attempt streamed; a delta that straddles the point that
    attempt reached is split there, so the stream goes on exactly where it ends (written whole,
    it would start below the stream's end and be refused, leaving a hole). The tokens up to the
    point are the streamed ones (_check_replayed), so the text past it is the regenerated text
    past the streamed one."""
    skip = min(max(0, result.replayed - result.tokens), len(delta.token_ids))
    if skip == 0:
        return DeltaEvent(i=result.tokens, text=delta.text, token_ids=delta.token_ids, attempt=attempt,
                          row=row, finish=finish, logprobs=delta.logprobs,
                          prompt_logprobs=delta.prompt_logprobs)
    regenerated = "".join(result.text) + delta.text
    return DeltaEvent(i=result.tokens + skip, text=regenerated[len(result.replayed_text):],
                      token_ids=delta.token_ids[skip:], attempt=attempt, row=row, finish=finish,
                      logprobs=delta.logprobs[skip:] if delta.logprobs is not None else None)


def _tool_calls(engine: Engine, row: dict[str, Any],
                text: str) -> tuple[list[dict[str, Any]] | None, str | None]:
    """What the deployment's tool-call parser finds in the output; a parser that fails on it
    leaves the text as the answer (as an output without calls)."""
    try:
        found = engine.tool_calls(row, text)
    except Exception:  # noqa: BLE001 - a parser's bug must not fail a finished generation
        log.exception("the tool-call parser %s failed on an output; answering with the text",
                      row.get("tool_parser"))
        return None, None
    return found if found is not None else (None, None)


def final_result(run: Running, outputs: list[RowOutput], error: str | None) -> FinalResult:
    """The request's one final: its stop reason wins over what the engine returned, since an
    aborted generation ends like a finished one. A request that cannot end with an output (its
    failure: see Diverged) fails with that error and no output."""
    msg = run.delivery.message
    if run.failure is not None:
        outputs, error = [], run.failure
    timings = Timings(enqueued=msg.enqueued_at, started=run.started, first_token=run.first_token,
                      finished=time.time())
    usage = Usage(prompt_tokens=run.prompt_tokens,
                  completion_tokens=sum(o.num_output_tokens for o in outputs))
    if run.stop_reason is not None:
        status = run.stop_reason
        error = ("cancelled by the client" if status is State.CANCELLED
                 else "the request passed its deadline while running")
    else:
        status = State.FAILED if error else State.DONE
    return FinalResult(
        status=status,
        output=outputs[0] if len(outputs) == 1 else None,
        rows=outputs if len(msg.rows) > 1 and outputs else None,
        error=error, usage=usage, timings=timings, attempt=run.delivery.attempt,
    )


def log_records(delivery: Delivery, final: FinalResult) -> list[dict[str, Any]]:
    """The request's inference-log records, one per row (the batch fields are added by the caller)."""
    outputs = final.rows or ([final.output] if final.output else [])
    return [
        {"request_id": delivery.message.id, "row": i, "status": final.status.value, "input": row,
         "output": outputs[i].record() if i < len(outputs) else None, "timings": final.timings.model_dump()}
        for i, row in enumerate(delivery.message.rows)
    ]
