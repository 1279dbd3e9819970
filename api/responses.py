"""OpenAI's Responses API, queue-backed: POST /v1/responses (with `background`, `stream`),
GET /v1/responses/{id} (polling, or `stream=true&starting_after=N` to resume a stream),
POST /v1/responses/{id}/cancel and DELETE /v1/responses/{id}.

A response is a Sluice request underneath (protocol/openai_responses.py): it waits in the same
queue, survives an api restart, and a worker crash resumes it like any other.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Query
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from sluice.api.auth import Caller, require_key
from sluice.api.errors import ApiError
from sluice.api.intake import Sampling
from sluice.api.intake import request_id as new_id
from sluice.api.requests import visible_model
from sluice.api.schemas import require_unicode
from sluice.api.state import ApiState, state
from sluice.api.streams import Slot, SlotStream
from sluice.broker.replies.router import LostFinal
from sluice.protocol.messages import CallerSeed, SamplingCore, SamplingExtras, declared
from sluice.protocol.openai_responses import EventSequence, ResponseRequest, request_id, response_object

router = APIRouter(prefix="/v1/responses", tags=["openai"])


def _not_found(response: str) -> ApiError:
    return ApiError(404, f"response {response!r} not found", code="not_found")


async def _find(s: ApiState, caller: Caller, response: str) -> tuple[str, str, dict]:
    """(request id, model, record) of a response the caller may see."""
    rid = request_id(response)
    if rid is None:
        raise _not_found(response)
    try:
        model = await visible_model(s, caller, rid)
    except ApiError as err:
        if err.status == 404:
            raise _not_found(response) from None
        raise
    meta = await s.responses.load(model, rid)
    if meta is None:  # a plain request, or a deleted response
        raise _not_found(response)
    return rid, model, meta


async def _object(s: ApiState, rid: str, model: str, meta: dict, wait_s: float = 0.0) -> dict:
    status = await s.lookup.wait_final(model, rid, wait_s)
    return response_object(rid, model, meta, status.state, status.result)


def _events(s: ApiState, slot: Slot, rid: str, model: str, meta: dict, after: int, *,
            owned: bool) -> EventSourceResponse:
    """The response's events after sequence number `after`. `owned`: the client that made a
    foreground streamed response owns it, and its disconnect cancels it (as chat streams do);
    a background response runs on whoever watches."""

    async def stream() -> AsyncIterator[dict]:
        events = EventSequence(rid, model, meta)
        done = False
        try:
            for seq, ev in events.start():
                if seq > after:
                    yield {"event": ev["type"], "data": json.dumps(ev)}
            async for reply in s.replies.follow(model, rid):
                if reply.delta is not None:
                    batch = events.delta(reply.delta)
                else:
                    assert reply.final is not None  # a reply is a delta or the final
                    lost_after = after if isinstance(reply, LostFinal) else None  # the reply stream expired
                    batch = events.end(reply.final, lost_after=lost_after)
                for seq, ev in batch:
                    if seq > after:
                        yield {"event": ev["type"], "data": json.dumps(ev)}
                done = reply.final is not None
        finally:
            if owned and not done:
                s.cancels.soon(model, rid)

    return SlotStream(slot, stream(), ping=15, shutdown_grace_period=s.settings.shutdown_timeout_s)


@router.post("")
async def create(body: ResponseRequest, s: ApiState = Depends(state), caller: Caller = Depends(require_key)):
    problems = await asyncio.to_thread(body.problems)  # compiles a structured-output constraint: off the loop
    if problems:
        raise ApiError(400, "; ".join(message for _, message in problems), param=problems[0][0])
    require_unicode([body.instructions, *[m["content"] for m in body.messages()]], "input")
    model = await s.deployments.get(body.model)
    # (its record keeps the tenant)
    rid, meta = new_id(model), {**body.meta(int(time.time())), "tenant": caller.tenant}
    slot = await s.streams.reserve(caller if body.stream else None)  # a refused stream queues nothing
    try:
        await s.responses.save(model.name, rid, meta)  # before the request: a worker may finish it at once
        chosen = declared(body, SamplingCore, CallerSeed, SamplingExtras)
        sampling = Sampling(**chosen, structured=body.structured())
        rows = [{"messages": body.messages(), "max_tokens": body.max_output_tokens}]
        try:
            await s.intake.enqueue(model, rows, sampling, rid=rid, owner=caller.digest, tenant=caller.tenant)
        except ApiError:
            await s.responses.delete(model.name, rid)
            raise
    except BaseException:
        slot.release()
        raise
    if body.stream:
        return _events(s, slot, rid, model.name, meta, -1, owned=not body.background)
    wait_s = 0.0 if body.background else s.settings.max_wait_s
    return JSONResponse(await _object(s, rid, model.name, meta, wait_s))


@router.get("/{response}")
async def retrieve(response: str, s: ApiState = Depends(state), caller: Caller = Depends(require_key),
                   stream: bool = Query(False, description="the response's events, from the start or after "
                                                           "`starting_after`"),
                   starting_after: int = Query(-1, ge=-1, description="resume after this sequence number")):
    rid, model, meta = await _find(s, caller, response)
    if stream:
        return _events(s, await s.streams.reserve(caller), rid, model, meta, starting_after, owned=False)
    return JSONResponse(await _object(s, rid, model, meta))


@router.post("/{response}/cancel")
async def cancel(response: str, s: ApiState = Depends(state), caller: Caller = Depends(require_key)):
    rid, model, meta = await _find(s, caller, response)
    if not meta.get("background"):
        raise ApiError(400, "only a background response can be cancelled", param="response_id")
    await s.cancels.now(model, rid)  # a final response stays as it is
    return JSONResponse(await _object(s, rid, model, meta))


@router.delete("/{response}")
async def delete(response: str, s: ApiState = Depends(state), caller: Caller = Depends(require_key)):
    rid, model, _ = await _find(s, caller, response)
    await s.cancels.now(model, rid)  # nothing runs for a response no one can read
    await s.responses.delete(model, rid)
    return {"id": response, "object": "response", "deleted": True}
