"""OpenAI-compatible routes, queue-backed: /v1/completions and /v1/chat/completions.

Each choice (prompt × n) is one request on the model's stream, with seed + i, so the
OpenAI SDK gets the same queue, workers, deadlines and cancellation as everything else.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from sluice.api.auth import Caller, require_key
from sluice.api.errors import ApiError
from sluice.api.intake import Sampling
from sluice.api.schemas import MAX_TOKENS, require_unicode
from sluice.api.state import ApiState, state
from sluice.config.model import ModelConfig
from sluice.protocol.ids import completion_id
from sluice.protocol.messages import FinalResult, RequestMessage
from sluice.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingBody,
    chat_object,
    completion_object,
)
from sluice.protocol.states import State

router = APIRouter(prefix="/v1", tags=["openai"])

async def _enqueue_choices(s: ApiState, model: ModelConfig, body: SamplingBody,
                           rows: list[dict[str, Any]], owner: str | None) -> list[RequestMessage]:
    bad = body.unsupported()
    if bad:
        raise ApiError(400, f"{', '.join(bad)}: not supported by this server", param=bad[0])
    # The OpenAI bodies' str-or-list fields let a lone surrogate through pydantic.
    for key in ("prompt", "messages"):
        require_unicode([row.get(key) for row in rows], key)
    require_unicode(body.stop, "stop")
    if any((row.get("max_tokens") or 0) > MAX_TOKENS for row in rows):
        raise ApiError(422, f"max_tokens: at most {MAX_TOKENS}", param="max_tokens")
    seed = body.seed if body.seed is not None else secrets.randbits(31)
    # All choices admitted at once, or none (one admission against the queue bound).
    sampling = Sampling(temperature=body.temperature, top_p=body.top_p, stop=tuple(body.stop or ()), seed=seed,
                        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty)
    return await s.intake.enqueue_many(model, [[row] for row in rows], sampling, owner=owner)


async def _finals(s: ApiState, model: str, messages: list[RequestMessage]) -> list[FinalResult]:
    statuses = await asyncio.gather(*(s.lookup.wait_final(model, m.id, s.settings.max_wait_s) for m in messages))
    finals = []
    for m, status in zip(messages, statuses):
        final = status.result
        if final is None:
            raise ApiError(504, f"no result within {s.settings.max_wait_s:.0f}s; poll GET /v1/requests/{m.id}",
                           code="timeout")
        if final.status is not State.DONE:
            raise ApiError(502 if final.status is State.FAILED else 504,
                           f"request {m.id} {final.status.value}: {final.error}", code="inference_failed")
        finals.append(final)
    return finals


def _stream(s: ApiState, model: str, messages: list[RequestMessage], chunk, include_usage: bool,
            first_chunks: list[dict] | None = None) -> EventSourceResponse:
    """Merge the choices' reply streams into OpenAI chunks, then `data: [DONE]`."""

    async def events() -> AsyncIterator[dict]:
        queue: asyncio.Queue = asyncio.Queue()
        finished: set[int] = set()

        async def follow(index: int, rid: str) -> None:
            try:
                async for ev in s.replies.follow(model, rid):
                    await queue.put((index, ev))
            finally:
                await queue.put((index, None))

        readers = [asyncio.create_task(follow(i, m.id)) for i, m in enumerate(messages)]
        usage = {"prompt_tokens": 0, "completion_tokens": 0}
        try:
            for c in first_chunks or []:
                yield {"data": json.dumps(c)}
            while len(finished) < len(messages):
                index, ev = await queue.get()
                if ev is None:
                    finished.add(index)
                elif ev.delta is not None and ev.delta.text:
                    yield {"data": json.dumps(chunk(index, ev.delta.text, None))}
                elif ev.final is not None:
                    f = ev.final
                    if f.usage:
                        usage["prompt_tokens"] += f.usage.prompt_tokens
                        usage["completion_tokens"] += f.usage.completion_tokens
                    reason = f.output.finish_reason if f.output else None
                    if f.status.value != "done":
                        yield {"data": json.dumps({"error": {"message": f"{f.status.value}: {f.error}",
                                                             "type": "inference_failed"}})}
                        reason = "abort"
                    yield {"data": json.dumps(chunk(index, "", reason or "stop"))}
            if include_usage:
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
                yield {"data": json.dumps({**chunk(0, "", None), "choices": [], "usage": usage})}
            yield {"data": "[DONE]"}
        finally:
            for r in readers:
                r.cancel()
            # The caller owns its choices, as with vLLM's server: a client gone before the
            # end frees the engine. (On SIGTERM the stream first runs on for up to the
            # shutdown timeout: see `sluice api`.)
            if len(finished) < len(messages):
                for m in messages:
                    s.cancels.soon(model, m.id)

    return EventSourceResponse(events(), ping=15, shutdown_grace_period=s.settings.shutdown_timeout_s)


@router.post("/completions")
async def completions(body: CompletionRequest, s: ApiState = Depends(state),
                      caller: Caller = Depends(require_key)):
    model = await s.deployments.get(body.model)
    rows = [{"prompt": p, "max_tokens": body.max_tokens} for p in body.prompt for _ in range(body.n)]
    messages = await _enqueue_choices(s, model, body, rows, caller.digest)
    cid, created = completion_id(messages[0].id, chat=False), int(time.time())

    def chunk(index: int, text: str, reason: str | None) -> dict:
        return {"id": cid, "object": "text_completion", "created": created, "model": model.name,
                "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": reason}]}

    if body.stream:
        include = bool(body.stream_options and body.stream_options.include_usage)
        return _stream(s, model.name, messages, chunk, include)
    return JSONResponse(completion_object(cid, model.name, created, await _finals(s, model.name, messages)))


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, s: ApiState = Depends(state),
                           caller: Caller = Depends(require_key)):
    model = await s.deployments.get(body.model)
    messages_in = [m.plain() for m in body.messages]
    rows = [{"messages": messages_in, "max_tokens": body.max_tokens} for _ in range(body.n)]
    messages = await _enqueue_choices(s, model, body, rows, caller.digest)
    cid, created = completion_id(messages[0].id, chat=True), int(time.time())

    def chunk(index: int, text: str, reason: str | None, role: bool = False) -> dict:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model.name,
                "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}]}

    if body.stream:
        include = bool(body.stream_options and body.stream_options.include_usage)
        first = [chunk(i, "", None, role=True) for i in range(len(messages))]
        return _stream(s, model.name, messages, chunk, include, first_chunks=first)
    return JSONResponse(chat_object(cid, model.name, created, await _finals(s, model.name, messages)))
