"""Native routes: submit a request, poll it, stream its tokens, cancel it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Header, Query
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from sluice.api.auth import Caller, require_key
from sluice.api.errors import ApiError, ErrorResponse, error_body
from sluice.api.intake import Sampling, request_id
from sluice.api.schemas import CallOptions, RequestView, SubmitRequest, Submitted
from sluice.api.sse import chunk, sse
from sluice.api.state import ApiState, state
from sluice.api.streams import SlotStream
from sluice.broker.replies.router import resume_index
from sluice.broker.status import RequestStatus
from sluice.protocol.messages import FinalResult, Sampled, declared
from sluice.protocol.states import State

router = APIRouter(prefix="/v1/requests", tags=["requests"])

def preferred_wait(prefer: str | None) -> float | None:
    """The `wait=S` preference of a Prefer header (RFC 7240), or None. `respond-async` wins, and a
    preference that cannot be read is ignored, as the RFC asks."""
    prefs = {}
    for part in (prefer or "").split(","):
        name, _, value = part.split(";")[0].strip().partition("=")
        prefs[name.strip().lower()] = value.strip().strip('"')
    if "respond-async" in prefs:
        return None
    try:
        wait = float(prefs.get("wait", ""))
    except ValueError:
        return None
    return wait if 0 < wait < float("inf") else None


@router.post("", status_code=202, response_model=Submitted, responses={
    200: {"model": RequestView,
          "description": "With `Prefer: wait=S`: the final result, ready within S seconds"}})
async def submit(
    body: SubmitRequest,
    s: ApiState = Depends(state),
    caller: Caller = Depends(require_key),
    idempotency_key: str | None = Header(None, max_length=256),
    prefer: str | None = Header(None, max_length=256, description=(
        "`wait=S` (RFC 7240): answer 200 with the final result if it is ready within S seconds "
        "(at most SLUICE_MAX_WAIT_S), else 202 as without it")),
) -> Submitted | JSONResponse:
    """Enqueue one request. With an Idempotency-Key, a repeat returns the first request's id.

    The key binds to a request id before anything is enqueued; a repeat whose first attempt
    left no trace (Redis failed in between) admits again under that same id, which
    admission treats as one request, so a retried call never makes two."""
    submitted = await _submit(body, s, caller, idempotency_key)
    wait = preferred_wait(prefer)
    if wait is None:
        return submitted
    wait = min(wait, s.settings.max_wait_s)
    status = await s.lookup.wait_final(submitted.model, submitted.id, wait, fresh=idempotency_key is None)
    applied = {"Preference-Applied": f"wait={wait:g}"}
    if not status.final:
        still = Submitted(id=submitted.id, status=status.state.value, model=submitted.model)
        return JSONResponse(still.model_dump(), status_code=202, headers=applied)
    return JSONResponse(view(status).model_dump(mode="json", exclude_none=True), headers=applied)


async def _submit(body: SubmitRequest, s: ApiState, caller: Caller, idempotency_key: str | None) -> Submitted:
    model = await s.deployments.get(body.model)
    rid = request_id(model, body.priority)
    # Without API keys every caller is one anonymous caller, and shares idempotency keys.
    key = f"{caller.digest or 'anonymous'}:{idempotency_key}" if idempotency_key else None
    if key:
        first = await s.admission.claim_idempotency(key, rid, model.name)
        if first:
            first_model, first_id = first
            status = await s.statuses.status(first_model, first_id)
            # The mark and the status are written by one script: a mark seen means the status
            # was there then, so a status read after the mark and gone is a result expired (not
            # a first admission that landed between two reads: that one is found now).
            if not status and await s.admission.was_admitted(first_model, first_id):
                status = await s.statuses.status(first_model, first_id)
                if not status:  # never run one id twice
                    raise ApiError(410, f"request {first_id!r}, made with this Idempotency-Key, has finished "
                                        "and its result expired (a result is kept for its model's retention "
                                        "after it finishes); send a new Idempotency-Key to run it again",
                                   code="expired")
            if status:
                return Submitted(id=first_id, status=status.state.value, model=first_model)
            model, rid = await s.deployments.get(first_model), first_id
    try:
        sampling = Sampling(**declared(body, Sampled, CallOptions), priority=body.priority)
        message = await s.intake.enqueue(model, [{"prompt": body.prompt, "max_tokens": body.max_tokens}],
                                         sampling, rid=rid, owner=caller.digest, keyed=key is not None,
                                         tenant=caller.tenant)
    except ApiError as err:
        if key and (err.status != 503 or err.code == "overloaded"):  # refused: nothing was enqueued
            await s.admission.release_idempotency(key)
        raise
    return Submitted(id=message.id, status="queued", model=model.name)


def final_view(rid: str, model: str, result: FinalResult) -> RequestView:
    """A final as every native route shows it: a field that is absent (None) is left out, at every
    level (an output row's logprobs, tool calls, extra fields; a timing not reached)."""
    return RequestView(id=rid, model=model, **result.model_dump(mode="json", exclude_none=True))


def view(status: RequestStatus) -> RequestView:
    if status.result is not None:
        return final_view(status.id, status.model, status.result)
    timings = {"enqueued": status.enqueued_at, "started": status.started_at}
    return RequestView(id=status.id, model=status.model, status=status.state.value,
                       timings={k: v for k, v in timings.items() if v is not None}, attempt=status.attempt)


async def visible(s: ApiState, caller: Caller, rid: str) -> tuple[str, RequestStatus]:
    """The request's model and status (one read), if the caller may see it: another key's request
    is as missing as an unknown id (404, not 403), so ids cannot be probed."""
    status = await s.lookup.status_of(rid)
    if not caller.admin and not caller.owns(status.owner):
        raise ApiError(404, f"request {rid!r} not found", code="not_found")
    return status.model, status


async def visible_model(s: ApiState, caller: Caller, rid: str) -> str:
    return (await visible(s, caller, rid))[0]


@router.get("/{rid}", response_model=RequestView, response_model_exclude_none=True)
async def get_request(
    rid: str,
    wait: float = Query(default=0.0, ge=0.0, description="long-poll up to this many seconds"),
    s: ApiState = Depends(state),
    caller: Caller = Depends(require_key),
) -> RequestView:
    model, status = await visible(s, caller, rid)
    return view(await s.lookup.wait_final(model, rid, min(wait, s.settings.max_wait_s), known=status))


@router.delete("/{rid}", response_model=RequestView, response_model_exclude_none=True, responses={
    202: {"model": Submitted,
          "description": "Running: `{id, model, status: \"cancelling\"}`; its worker aborts it and it ends "
                         "`cancelled`"},
    409: {"description": "Final already (`done`, `failed`, `expired`, `cancelled`): nothing changes; the "
                         "error names the state, and `request` holds the final as GET shows it"}})
async def cancel(rid: str, s: ApiState = Depends(state),
                 caller: Caller = Depends(require_key)) -> RequestView | JSONResponse:
    """Cancel a request. A queued one ends `cancelled` at once: 200 with that final."""
    model, before = await visible(s, caller, rid)
    if before.final:
        return _already_final(before)
    result = await s.cancels.now(model, rid)
    if result == "cancelling":
        return JSONResponse(Submitted(id=rid, status=result, model=model).model_dump(), status_code=202)
    after = await s.statuses.status(model, rid) if result else None
    if after is None:
        raise ApiError(404, f"request {rid!r} not found", code="not_found")
    if result == "cancelled" and before.state is State.QUEUED:
        return view(after)  # (the script answers 'cancelled' for one final already, too)
    return _already_final(after)  # it became final between the read and the script


def _already_final(status: RequestStatus) -> JSONResponse:
    """409: a final request cannot be cancelled (RFC 9110, 15.5.10); its final comes with it."""
    body = error_body(f"request {status.id!r} is already {status.state.value}: only a queued or running "
                      "request can be cancelled", "already_final", "id")
    body["request"] = view(status).model_dump(mode="json", exclude_none=True)
    return ErrorResponse(body, 409)


@router.get("/{rid}/events")
async def events(
    rid: str,
    s: ApiState = Depends(state),
    caller: Caller = Depends(require_key),
    last_event_id: str | None = Header(
        None, alias="Last-Event-ID",
        description="Resume after this event: the `id` of the last event received (a browser's "
                    "EventSource sends it when it reconnects)."),
) -> EventSourceResponse:
    """Server-sent events: `delta` ({index, text}) per token batch, then `done` or `error`.

    Resumable with Last-Event-ID. Watching is not owning: a reader that disconnects cancels
    nothing (DELETE does). A stream silent for `SLUICE_SSE_IDLE_TIMEOUT_S` closes with a
    comment; the client reconnects with its Last-Event-ID.
    """
    model, status = await visible(s, caller, rid)
    last_id = last_event_id or "0"
    try:
        next_index = await resume_index(s.redis, model, rid, last_id) if last_id != "0" else 0
    except ValueError:
        raise ApiError(400, f"Last-Event-ID: {last_event_id!r} is not the id of an event of this stream",
                       param="Last-Event-ID") from None
    idle_s = s.settings.sse_idle_timeout_s

    async def stream() -> AsyncIterator[dict | bytes]:
        # A read's events in one chunk: one write per read (api/sse.py).
        # (not final when read just now: its stream cannot have expired, no status read first)
        async for read in s.replies.follow_reads(model, rid, after=last_id, next_index=next_index,
                                                 idle_timeout_s=idle_s, fresh=not status.final):
            out = []
            for ev in read:
                if ev.delta is not None:
                    text = json.dumps(ev.delta.text)
                    data = f'{{"index": {ev.delta.i}, "text": {text}, "row": {ev.delta.row}}}'
                    out.append(sse(data, "delta", ev.entry_id))
                elif ev.final is not None:
                    final = final_view(rid, model, ev.final)
                    kind = "done" if ev.final.status is State.DONE else "error"
                    out.append(sse(final.model_dump_json(exclude_none=True), kind, ev.entry_id))
            yield chunk(out)
            if read[-1].final is not None:
                return
        # Closed so that an idle reader does not hold the connection (and a proxy's) forever.
        yield {"comment": f"no event for {idle_s:g}s: reconnect with Last-Event-ID to go on"}

    # On SIGTERM, open streams run to their end for up to the shutdown timeout (see `sluice api`).
    return SlotStream(await s.streams.reserve(caller), stream(), ping=15,
                      shutdown_grace_period=s.settings.shutdown_timeout_s)
