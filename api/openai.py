"""OpenAI-compatible routes, queue-backed: /v1/completions and /v1/chat/completions.

Each choice (prompt × n) is one request on the model's stream, with seed + i, so the
OpenAI SDK gets the same queue, workers, deadlines and cancellation as everything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Protocol

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from sluice.api.auth import Caller, require_key
from sluice.api.errors import ApiError
from sluice.api.intake import Sampling
from sluice.api.schemas import require_unicode
from sluice.api.sse import chunk, sse
from sluice.api.state import ApiState, state
from sluice.api.streams import Slot, SlotStream
from sluice.config.model import ModelConfig
from sluice.protocol.ids import completion_id
from sluice.protocol.messages import DeltaEvent, FinalResult, RequestMessage, TokenLogprob
from sluice.protocol.openai import ChatCompletionRequest, CompletionRequest, SamplingBody
from sluice.protocol.openai_objects import (
    Shape,
    chat_logprobs,
    chat_message,
    chat_object,
    completion_logprobs,
    completion_object,
)
from sluice.protocol.rows import max_tokens_problem
from sluice.protocol.states import State

router = APIRouter(prefix="/v1", tags=["openai"])

async def _enqueue_choices(s: ApiState, model: ModelConfig, body: SamplingBody,
                           rows: list[dict[str, Any]], caller: Caller) -> tuple[Slot, list[RequestMessage]]:
    """The call's choices admitted, and (for a stream) its slot among its key's open streams,
    taken first: a stream refused by the cap queues nothing."""
    # A structured output's constraint is compiled to check it: off the loop (a thread hop for
    # nothing otherwise)
    problems = await asyncio.to_thread(body.problems) if body.constrained() else body.problems()
    if problems:
        raise ApiError(400, "; ".join(message for _, message in problems), param=problems[0][0])
    # The OpenAI bodies' str-or-list fields let a lone surrogate through pydantic.
    for key in ("prompt", "messages"):
        require_unicode([row.get(key) for row in rows], key)
    require_unicode(body.stop, "stop")
    too_many = max_tokens_problem(max(row.get("max_tokens") or 0 for row in rows))  # before any slot is taken
    if too_many:
        raise ApiError(too_many.status, too_many.message, param=too_many.param)
    seed = body.seed if body.seed is not None else secrets.randbits(31)
    # All choices admitted at once, or none (one admission against the queue bound).
    sampling = Sampling(seed=seed, **body.sampling_fields())
    slot = await s.streams.reserve(caller if body.stream else None)
    try:
        return slot, await s.intake.enqueue_many(model, [[row] for row in rows], sampling,
                                                 owner=caller.digest, tenant=caller.tenant)
    except BaseException:
        slot.release()
        raise


async def _finals(s: ApiState, model: str, messages: list[RequestMessage]) -> list[FinalResult]:
    statuses = await asyncio.gather(*(s.lookup.wait_final(model, m.id, s.settings.max_wait_s, fresh=True)
                                      for m in messages))
    finals = []
    for m, status in zip(messages, statuses):
        final = status.result
        if final is None:
            raise ApiError(504, f"no result within {s.settings.max_wait_s:.0f}s; poll GET "
                                f"/v1/requests/{m.id}", code="timeout")
        if final.status is not State.DONE:
            raise ApiError(502 if final.status is State.FAILED else 504,
                           f"request {m.id} {final.status.value}: {final.error}", code="inference_failed")
        finals.append(final)
    return finals


class Chunks(Protocol):
    """A route's stream chunks: those of a choice's delta, and those ending the choice."""

    def first(self) -> list[dict]: ...

    def delta(self, index: int, delta: DeltaEvent) -> list[dict]: ...

    def end(self, index: int, final: FinalResult, reason: str) -> list[dict]: ...

    def usage(self, usage: dict[str, int]) -> dict: ...


def _stream(s: ApiState, slot: Slot, model: str, messages: list[RequestMessage], chunks: Chunks,
            include_usage: bool) -> EventSourceResponse:
    """Merge the choices' reply streams into OpenAI chunks, then `data: [DONE]`."""

    async def events() -> AsyncIterator[dict | bytes]:
        finished: set[int] = set()
        usage = {"prompt_tokens": 0, "completion_tokens": 0}
        try:
            for c in chunks.first():
                yield {"data": json.dumps(c)}
            async with contextlib.aclosing(_merged(s, model, messages)) as merged:
                async for ready in merged:
                    out: list[dict] = []
                    for index, ev in ready:
                        if ev is None:
                            finished.add(index)
                        elif ev.delta is not None and ev.delta.token_ids:
                            out += chunks.delta(index, ev.delta)
                        elif ev.final is not None:
                            f = ev.final
                            if f.usage:
                                usage["prompt_tokens"] += f.usage.prompt_tokens
                                usage["completion_tokens"] += f.usage.completion_tokens
                            reason = (f.output.finish_reason if f.output else None) or "stop"
                            if f.status.value != "done":
                                out.append({"error": {"message": f"{f.status.value}: {f.error}",
                                                      "type": "inference_failed"}})
                                reason = "abort"
                            out += chunks.end(index, f, reason)
                    if out:  # one write for what arrived together (api/sse.py)
                        yield chunk([sse(json.dumps(c)) for c in out])
            if include_usage:
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
                yield {"data": json.dumps(chunks.usage(usage))}
            yield {"data": "[DONE]"}
        finally:
            # The caller owns its choices, as with vLLM's server: a client gone before the
            # end frees the engine. (On SIGTERM the stream first runs on for up to the
            # shutdown timeout: see `sluice api`.)
            if len(finished) < len(messages):
                for m in messages:
                    s.cancels.soon(model, m.id)

    return SlotStream(slot, events(), ping=15, shutdown_grace_period=s.settings.shutdown_timeout_s)


async def _merged(s: ApiState, model: str,
                  messages: list[RequestMessage]) -> AsyncGenerator[list[tuple[int, Any]], None]:
    """The choices' reply events as they arrive, (choice, event) with (choice, None) once a choice's
    stream ends; what arrived together comes as one list (one write). One choice is followed
    directly; several through a reader task each."""
    if len(messages) == 1:
        async with contextlib.aclosing(s.replies.follow_reads(model, messages[0].id, fresh=True)) as reads:
            async for read in reads:
                yield [(0, ev) for ev in read]
        yield [(0, None)]
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def follow(index: int, rid: str) -> None:
        try:
            async for ev in s.replies.follow(model, rid, fresh=True):
                await queue.put((index, ev))
        finally:
            await queue.put((index, None))

    readers = [asyncio.create_task(follow(i, m.id)) for i, m in enumerate(messages)]
    try:
        ended = 0
        while ended < len(messages):
            ready = [await queue.get()]
            while not queue.empty():  # what arrived meanwhile goes out in the same write
                ready.append(queue.get_nowait())
            ended += sum(ev is None for _, ev in ready)
            yield ready
    finally:
        for r in readers:
            r.cancel()


class CompletionChunks:
    def __init__(self, cid: str, model: str, shape: Shape, prompts: list[str]) -> None:
        self.head = {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model}
        self.shape, self.prompts = shape, prompts
        self.offset = [0] * len(prompts)  # characters sent per choice (text_offset)
        self.echoed = [not shape.echo] * len(prompts)

    def _chunk(self, index: int, text: str, tokens: list[TokenLogprob] | None, reason: str | None) -> dict:
        logprobs = None
        if self.shape.logprobs is not None and tokens is not None:
            logprobs = completion_logprobs(tokens, self.offset[index])
        self.offset[index] += len(text)
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        return {**self.head, "choices": [choice]}

    def _echo(self, index: int, prompt_logprobs: list[TokenLogprob] | None) -> list[dict]:
        if self.echoed[index]:
            return []
        self.echoed[index] = True
        return [self._chunk(index, self.prompts[index], prompt_logprobs or [], None)]

    def first(self) -> list[dict]:
        return []

    def delta(self, index: int, delta: DeltaEvent) -> list[dict]:
        echo = self._echo(index, delta.prompt_logprobs)
        return [*echo, self._chunk(index, delta.text, delta.logprobs or [], None)]

    def end(self, index: int, final: FinalResult, reason: str) -> list[dict]:
        echo = self._echo(index, final.output.prompt_logprobs if final.output else None)
        return [*echo, self._chunk(index, "", None, reason)]

    def usage(self, usage: dict[str, int]) -> dict:
        return {**self.head, "choices": [], "usage": usage}


class ChatChunks:
    def __init__(self, cid: str, model: str, shape: Shape, rids: list[str]) -> None:
        self.head = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
                     "model": model}
        self.shape, self.rids = shape, rids

    def _chunk(self, index: int, delta: dict, reason: str | None = None,
               logprobs: dict | None = None) -> dict:
        return {**self.head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                          "finish_reason": reason}]}

    def first(self) -> list[dict]:
        return [self._chunk(i, {"role": "assistant", "content": ""}) for i in range(len(self.rids))]

    def delta(self, index: int, delta: DeltaEvent) -> list[dict]:
        if self.shape.tool:  # sent whole at the end, as tool_calls (or as text if incomplete)
            return []
        logprobs = chat_logprobs(delta.logprobs or []) if self.shape.logprobs is not None else None
        return [self._chunk(index, {"content": delta.text}, logprobs=logprobs)]

    def end(self, index: int, final: FinalResult, reason: str) -> list[dict]:
        out = []
        if self.shape.tool and final.output is not None:
            message, reason = chat_message(self.shape, final.output, reason, self.rids[index])
            calls = [{"index": k, **call} for k, call in enumerate(message.get("tool_calls") or [])]
            called = {"tool_calls": calls} if calls else {"content": message["content"]}
            out.append(self._chunk(index, called))
        return [*out, self._chunk(index, {}, reason)]

    def usage(self, usage: dict[str, int]) -> dict:
        return {**self.head, "choices": [], "usage": usage}


@router.post("/completions")
async def completions(body: CompletionRequest, s: ApiState = Depends(state),
                      caller: Caller = Depends(require_key)):
    model = await s.deployments.get(body.model)
    s.intake.check_call_size(len(body.prompt) * body.n, "prompt")  # before a row is built
    prompts = [p for p in body.prompt for _ in range(body.n)]
    rows: list[dict[str, Any]] = [{"prompt": p, "max_tokens": body.max_tokens} for p in prompts]
    slot, messages = await _enqueue_choices(s, model, body, rows, caller)
    cid, shape = completion_id(messages[0].id, chat=False), body.shape()
    if body.stream:
        include = bool(body.stream_options and body.stream_options.include_usage)
        chunks = CompletionChunks(cid, model.name, shape, prompts)
        return _stream(s, slot, model.name, messages, chunks, include)
    finals = await _finals(s, model.name, messages)
    return JSONResponse(completion_object(cid, model.name, int(time.time()), finals, shape, prompts))


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, s: ApiState = Depends(state),
                           caller: Caller = Depends(require_key)):
    model = await s.deployments.get(body.model)
    body.with_parser(model.tool_call_parser)
    rows = [{**body.rows(), "max_tokens": body.max_tokens} for _ in range(body.n)]
    slot, messages = await _enqueue_choices(s, model, body, rows, caller)
    cid, shape, rids = completion_id(messages[0].id, chat=True), body.shape(), [m.id for m in messages]
    if body.stream:
        include = bool(body.stream_options and body.stream_options.include_usage)
        return _stream(s, slot, model.name, messages, ChatChunks(cid, model.name, shape, rids), include)
    finals = await _finals(s, model.name, messages)
    return JSONResponse(chat_object(cid, model.name, int(time.time()), finals, shape, rids))
