"""Model routes: deployments and versions, reconfiguration, multi-row inference, the inference log."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, model_validator

from sluice.api.arrow import ARROW_STREAM, RowLimits, encode_rows, encode_table, parse_rows, wants_arrow
from sluice.api.auth import CLOSE_UNREAD, Caller, require_admin, require_key
from sluice.api.errors import ApiError
from sluice.api.intake import Sampling
from sluice.api.schemas import CallOptions
from sluice.api.state import ApiState, state
from sluice.broker.intake.queues import queue_figures
from sluice.config.batching import ContinuousBatchingConfig, DynamicBatchingConfig
from sluice.config.model import ConfigError, ModelConfig, parse_model
from sluice.config.schema import to_arrow
from sluice.protocol.messages import declared
from sluice.protocol.states import State

router = APIRouter(prefix="/v1/models", tags=["models"])
MAX_BATCH = 100_000  # far above any engine's batch


def describe(m: ModelConfig) -> dict[str, Any]:
    return {
        "id": m.name, "object": "model", "created": 0, "owned_by": "sluice",
        "version": m.version, "mode": m.mode.value, "framework": m.framework,
        "config": m.model_dump(mode="json", exclude={"name", "version"}),
    }


@router.get("")
async def list_models(s: ApiState = Depends(state)) -> dict:
    return {"object": "list", "data": [describe(m) for m in (await s.deployments.all(fresh=True)).values()]}


@router.get("/{model}")
async def get_model(model: str, s: ApiState = Depends(state), caller: Caller = Depends(require_key)) -> dict:
    m = await s.deployments.get(model)
    queue = await queue_figures(s.redis, m.name, m.shards)
    live = [w for w in await s.workers.live(s.settings.worker_ttl_s) if w.model == m.name]
    return {
        **describe(m),
        # Waiting and running apart, per lane; the bound counts both.
        "queue": {**{lane: figures.view() for lane, figures in queue.items()},
                  "max_queued": m.max_queued or s.settings.max_queued},
        # Worker names carry host names: an admin's business, as /v1/workers is.
        "workers": [{**({"name": w.name} if caller.admin else {}), "version": w.version,
                     "in_flight": w.in_flight} for w in live],
    }


class ConfigureRequest(BaseModel):
    """The seeds' configure(): exactly one batching mode."""

    model_config = ConfigDict(extra="forbid")

    continuous_batching_config: ContinuousBatchingConfig | None = None
    dynamic_batching_config: DynamicBatchingConfig | None = None
    batch_config: Literal["single"] | None = None

    @model_validator(mode="after")
    def _bounded(self) -> ConfigureRequest:
        # Over HTTP, sizes stay within what a worker can ask Redis for: a batch size of 10**23
        # was accepted and left the model's worker failing every XREADGROUP (COUNT out of range).
        given = {**(self.continuous_batching_config or ContinuousBatchingConfig()).model_dump(),
                 **(self.dynamic_batching_config or DynamicBatchingConfig()).model_dump()}
        for name, most in (("max_concurrent_batch_size", MAX_BATCH), ("batch_size_target", MAX_BATCH),
                           ("batch_size_limit", MAX_BATCH), ("max_batch_delay_ms", 3_600_000)):
            if (given.get(name) or 0) > most:
                raise ValueError(f"{name}: at most {most}")
        return self


@router.put("/{model}/config", dependencies=[Depends(require_admin)])
async def configure(model: str, body: ConfigureRequest, s: ApiState = Depends(state)) -> dict:
    current = await s.deployments.get(model)
    given = body.model_dump(exclude_none=True)
    if not given:
        raise ApiError(400, "set one of continuous_batching_config, dynamic_batching_config, "
                            "batch_config='single'")
    data = current.model_dump(mode="json")
    data.update(continuous_batching_config=None, dynamic_batching_config=None, batch_config=None)
    data.update(given)
    try:
        updated = parse_model(data)
    except ConfigError as err:
        raise ApiError(400, str(err)) from None
    return describe(await s.deployments.deploy(updated))


# The route reads its body itself (JSON records or Arrow), so the OpenAPI document is told
# what it takes: clients, and the schemathesis fuzz, see both media types.
_BINARY = {"schema": {"type": "string", "format": "binary"}}
_RECORDS = {"schema": {"type": "array", "minItems": 1, "items": {
    "type": "object", "additionalProperties": True,  # the model's input schema may add fields
    "properties": {"prompt": {"type": "string", "minLength": 1},
                   "max_tokens": {"type": "integer", "minimum": 1}}}}}
_INFER_OPENAPI = {
    "requestBody": {"required": True, "content": {"application/json": _RECORDS, ARROW_STREAM: _BINARY}},
    "responses": {"200": {"description": "one output row per input row, in order",
                          "content": {"application/json": {"schema": {"type": "array",
                                                                      "items": {"type": "object"}}},
                                      ARROW_STREAM: _BINARY}}},
}


@router.post("/{model}/infer", openapi_extra=_INFER_OPENAPI)
async def infer(
    model: str,
    request: Request,
    options: Annotated[CallOptions, Query()],  # temperature, top_p, seed, timeout_s
    s: ApiState = Depends(state),
    caller: Caller = Depends(require_key),
) -> Response:
    """Rows in (JSON records or Arrow), one output row per input row, in order, out."""
    m = await s.deployments.get(model)
    # The model is in the path: a tenant out of requests is refused before the body.
    if s.intake.tenant_limits:
        try:
            await s.intake.tenant_limits.refuse_early(m, caller.tenant)
        except ApiError:
            # Its body is left unread: the connection closes after the answer.
            request.scope[CLOSE_UNREAD] = True
            raise
    content_type = request.headers.get("content-type")
    body = await request.body()  # bounded by the BodySizeLimit middleware
    rows = parse_rows(body, content_type, to_arrow(m.input_schema), RowLimits.of(s.settings))
    message = await s.intake.enqueue(m, rows, Sampling(**declared(options, CallOptions)), owner=caller.digest,
                                     tenant=caller.tenant)
    wait_s = min(message.deadline - message.enqueued_at, s.settings.max_wait_s)
    status = await s.lookup.wait_final(m.name, message.id, wait_s, fresh=True)
    result = status.result
    if status.state is not State.DONE or result is None:
        code = {State.EXPIRED: 504, State.CANCELLED: 409}.get(status.state, 502)
        error = result.error if result else None
        if not status.state.final:
            code, error = 504, f"no result yet: poll GET /v1/requests/{message.id}"
        raise ApiError(code, f"request {message.id}: {status.state.value}: {error or 'no result'}",
                       code="inference_failed")
    records = [o.record() for o in (result.rows or ([result.output] if result.output else []))]
    schema = to_arrow(m.output_schema)
    headers = {"X-Request-Id": message.id}
    if wants_arrow(content_type) or ARROW_STREAM in request.headers.get("accept", ""):
        return Response(encode_rows(records, schema), media_type=ARROW_STREAM, headers=headers)
    return JSONResponse([{n: r.get(n) for n in schema.names} for r in records], headers=headers)


@router.get("/{model}/logs", dependencies=[Depends(require_admin)])
async def logs(
    model: str,
    request: Request,
    limit: int = Query(100, ge=1, le=10_000),
    s: ApiState = Depends(state),
) -> Response:
    """The newest `limit` inference-log records, oldest first (Arrow with Accept: arrow stream).
    Admin only: the log holds every caller's prompts and outputs."""
    m = await s.deployments.get(model)
    records = await s.inference_log.newest(m.name, limit)
    if ARROW_STREAM in request.headers.get("accept", ""):
        return Response(encode_table(records), media_type=ARROW_STREAM)
    return JSONResponse(records)
