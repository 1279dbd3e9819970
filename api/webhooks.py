"""Webhook endpoints (`/v1/webhooks`, admin keys only): create one (its secret shown once), list,
rotate the secret, disable or enable, delete, send a test event; the dead deliveries and their
replay. docs/webhooks.md tells the whole story."""

from __future__ import annotations

import asyncio
import re
import uuid

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, ConfigDict, Field

from sluice.api.auth import Caller, require_admin
from sluice.api.errors import ApiError
from sluice.api.state import ApiState, state
from sluice.broker.webhooks.deliveries import Deliveries
from sluice.broker.webhooks.endpoints import Endpoint, EndpointStore
from sluice.protocol.webhooks import EVENT_TYPES, UnsafeUrl, check_literal, check_url, probe_payload, resolve

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"], dependencies=[Depends(require_admin)])
_DIGEST = re.compile(r"[0-9a-f]{64}")


class EndpointCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(max_length=2048)
    events: list[str] = Field(default_factory=list, max_length=len(EVENT_TYPES),
                              description="event types to send (none: all)")
    owner: str | None = Field(None, description="the api key digest (sha256 hex) whose work it hears of; "
                                                "default: the caller's key ('' without keys)")
    description: str = Field("", max_length=500)


async def check_endpoint_url(url: str, allow_private: bool) -> None:
    """UnsafeUrl for a URL a sender must not post to: its host is checked as written and as it
    resolves now (a sender checks again at every delivery)."""
    _, host, port = check_url(url)
    check_literal(host, allow_private=allow_private)
    try:  # a name whose DNS never answers is refused, not waited for
        await asyncio.wait_for(asyncio.to_thread(resolve, host, port, allow_private=allow_private), 5.0)
    except TimeoutError:
        raise UnsafeUrl(f"webhook host {host!r} did not resolve within 5 s") from None


def _bad(err: Exception, param: str) -> ApiError:
    return ApiError(400, str(err), param=param)


async def _found(store: EndpointStore, endpoint_id: str) -> Endpoint:
    endpoint = await store.get(endpoint_id)
    if endpoint is None:
        raise ApiError(404, f"webhook endpoint {endpoint_id!r} not found", code="not_found")
    return endpoint


@router.post("", status_code=201)
async def create(body: EndpointCreate, s: ApiState = Depends(state),
                 caller: Caller = Depends(require_admin)) -> dict:
    unknown = sorted(set(body.events) - set(EVENT_TYPES) - {"*"})
    if unknown:
        raise ApiError(400, f"unknown event types {unknown}; known: {', '.join(EVENT_TYPES)}", param="events")
    owner = body.owner if body.owner is not None else (caller.digest or "")
    if owner and not _DIGEST.fullmatch(owner):
        raise ApiError(400, "owner must be an api key's sha256 digest (64 hex digits; `sluice keys` shows "
                            "it) or '' for the api without keys", param="owner")
    try:
        await check_endpoint_url(body.url, s.settings.webhooks_allow_private)
    except UnsafeUrl as err:
        raise _bad(err, "url") from None
    endpoint = await EndpointStore(s.redis).create(body.url, body.events, owner, body.description)
    return {**endpoint.public(), "secret": endpoint.secret}


@router.get("")
async def list_endpoints(owner: str | None = Query(None, max_length=64),
                         s: ApiState = Depends(state)) -> dict:
    return {"object": "list", "data": [e.public() for e in await EndpointStore(s.redis).list(owner)]}


@router.get("/dead")
async def dead(limit: int = Query(100, ge=1, le=10_000), s: ApiState = Depends(state)) -> dict:
    """Deliveries that used up their retry period, newest first."""
    return {"object": "list", "data": await Deliveries(s.redis).dead(limit)}


@router.post("/dead/replay")
async def replay(ids: list[str] | None = None, s: ApiState = Depends(state)) -> dict:
    """Deliver dead deliveries again (all, or those whose id or event id is named)."""
    return {"replayed": await Deliveries(s.redis).replay(ids)}


@router.get("/{endpoint_id}")
async def get(endpoint_id: str, s: ApiState = Depends(state)) -> dict:
    return (await _found(EndpointStore(s.redis), endpoint_id)).public()


@router.post("/{endpoint_id}/rotate")
async def rotate(endpoint_id: str, s: ApiState = Depends(state)) -> dict:
    """A new secret, shown once; the previous one still signs (beside it) for 24 h."""
    store = EndpointStore(s.redis)
    await _found(store, endpoint_id)
    endpoint = await store.rotate(endpoint_id)
    if endpoint is None:
        raise ApiError(404, f"webhook endpoint {endpoint_id!r} not found", code="not_found")
    return {**endpoint.public(), "secret": endpoint.secret}


@router.post("/{endpoint_id}/disable")
async def disable(endpoint_id: str, s: ApiState = Depends(state)) -> dict:
    return await _enable(s, endpoint_id, False)


@router.post("/{endpoint_id}/enable")
async def enable(endpoint_id: str, s: ApiState = Depends(state)) -> dict:
    return await _enable(s, endpoint_id, True)


async def _enable(s: ApiState, endpoint_id: str, enabled: bool) -> dict:
    endpoint = await EndpointStore(s.redis).set_enabled(endpoint_id, enabled)
    if endpoint is None:
        raise ApiError(404, f"webhook endpoint {endpoint_id!r} not found", code="not_found")
    return endpoint.public()


@router.post("/{endpoint_id}/test", status_code=202)
async def test(endpoint_id: str, s: ApiState = Depends(state)) -> dict:
    """A `webhook.test` event for this endpoint alone, delivered by a sender like any other."""
    endpoint = await _found(EndpointStore(s.redis), endpoint_id)
    event = f"msg_{uuid.uuid4().hex}"
    await Deliveries(s.redis).enqueue([(endpoint.id, event, probe_payload(event))], lease_s=0)
    return {"id": event, "object": "event", "type": "webhook.test"}


@router.delete("/{endpoint_id}")
async def delete(endpoint_id: str, s: ApiState = Depends(state)) -> dict:
    if not await EndpointStore(s.redis).delete(endpoint_id):
        raise ApiError(404, f"webhook endpoint {endpoint_id!r} not found", code="not_found")
    return {"id": endpoint_id, "object": "webhook_endpoint.deleted", "deleted": True}
