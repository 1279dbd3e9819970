"""Files and batches in the OpenAI Batch API format; jobs run on Celery workers (`sluice jobs`)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, File, Form, Query, UploadFile
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from sluice.api.auth import Caller, require_key
from sluice.api.errors import ApiError
from sluice.api.metrics import TENANT_REFUSED
from sluice.api.state import ApiState, state
from sluice.broker.jobs.files import FileError
from sluice.broker.jobs.store import ENDPOINTS
from sluice.protocol.openai_responses import bounded_metadata
from sluice.protocol.tasks import JOB_QUEUE, JOB_TASK

router = APIRouter(prefix="/v1", tags=["files and batches"])


def _file_error(err: FileError) -> ApiError:
    if err.status == 429:  # a tenant's stored files at a limit
        return ApiError(429, str(err), code="rate_limit_exceeded", headers={"Retry-After": "60"})
    return ApiError(err.status, str(err), code="not_found" if err.status == 404 else "invalid_request_error")


def _public(meta: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI file object: which key (and tenant) owns it stays inside."""
    return {k: v for k, v in meta.items() if k not in ("owner", "tenant")}


async def _own_file(s: ApiState, caller: Caller, file_id: str) -> dict[str, Any]:
    """A file the caller may use; another key's file is as missing as an unknown id."""
    try:
        meta = await s.files.get(file_id)
    except FileError as err:
        raise _file_error(err) from None
    if not caller.owns(meta.get("owner")):
        raise ApiError(404, f"file {file_id!r} not found", code="not_found")
    return meta


@router.post("/files")
async def upload(
    file: UploadFile = File(...), purpose: str = Form(...),
    expires_anchor: str | None = Form(None, alias="expires_after[anchor]", pattern="^created_at$"),
    expires_seconds: int | None = Form(None, alias="expires_after[seconds]", ge=3600, le=30 * 86400),
    s: ApiState = Depends(state),
    caller: Caller = Depends(require_key),
) -> dict:
    """`expires_after` as in OpenAI's Files API (default: SLUICE_FILE_TTL_S, 30 days)."""
    config = s.tenants.get(caller.tenant)
    try:
        # Starlette has spooled the upload to a temporary file: it is copied in chunks, off the loop.
        return _public(await s.files.create_from(file.filename or "upload.jsonl", purpose, file.file,
                                                 expires_after_s=expires_seconds, owner=caller.digest,
                                                 upload=True, tenant=caller.tenant,
                                                 tenant_limits=(config.max_files, config.max_file_bytes)))
    except FileError as err:
        if err.status == 429:
            TENANT_REFUSED.labels(caller.tenant, "stored_files").inc()
        raise _file_error(err) from None


def _page(data: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    """An OpenAI list page from `limit` + 1 items read (the extra one says there are more)."""
    page = data[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(data) > limit}


@router.get("/files")
async def list_files(purpose: str | None = None, limit: int = Query(10_000, ge=1, le=10_000),
                     after: str | None = Query(None, max_length=128), s: ApiState = Depends(state),
                     caller: Caller = Depends(require_key)) -> dict:
    """Newest first, as OpenAI lists files; a key's listing reads only its own files."""
    data = await s.files.list(purpose, owner=caller.lists, after=after, limit=limit + 1)
    return _page([_public(m) for m in data], limit)


@router.get("/files/{file_id}")
async def get_file(file_id: str, s: ApiState = Depends(state), caller: Caller = Depends(require_key)) -> dict:
    return _public(await _own_file(s, caller, file_id))


@router.get("/files/{file_id}/content")
async def file_content(file_id: str, s: ApiState = Depends(state),
                       caller: Caller = Depends(require_key)) -> StreamingResponse:
    """Streamed from disk a chunk at a time (never whole in the api's memory)."""
    await _own_file(s, caller, file_id)
    try:
        size, chunks = await s.files.stream(file_id)
    except FileError as err:
        raise _file_error(err) from None
    return StreamingResponse(chunks, media_type="application/octet-stream",
                             headers={"Content-Length": str(size)})


@router.delete("/files/{file_id}")
async def delete_file(file_id: str, s: ApiState = Depends(state),
                      caller: Caller = Depends(require_key)) -> dict:
    await _own_file(s, caller, file_id)
    try:
        await s.files.delete(file_id)
    except FileError as err:
        raise _file_error(err) from None
    return {"id": file_id, "object": "file", "deleted": True}


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1)
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        return None if metadata is None else bounded_metadata(metadata)


@router.post("/batches")
async def create_batch(body: CreateBatch, s: ApiState = Depends(state),
                       caller: Caller = Depends(require_key)) -> dict[str, Any]:
    if body.endpoint not in ENDPOINTS:
        raise ApiError(400, f"endpoint: must be one of {', '.join(ENDPOINTS)}", param="endpoint")
    if body.completion_window != "24h":
        raise ApiError(400, "completion_window: only '24h' is supported", param="completion_window")
    meta = await _own_file(s, caller, body.input_file_id)
    if meta["purpose"] != "batch":
        raise ApiError(400, f"input_file_id: file {body.input_file_id} has purpose {meta['purpose']!r}, "
                            "not 'batch'", param="input_file_id")
    await _within_limits(s, body.input_file_id)
    batch = await s.jobs.create(body.input_file_id, body.endpoint, body.completion_window, body.metadata,
                                   owner=caller.digest, tenant=caller.tenant)
    # kombu publishes synchronously: keep it off the event loop.
    await asyncio.to_thread(s.celery.send_task, JOB_TASK, [batch["id"]], queue=JOB_QUEUE)
    return batch


async def _within_limits(s: ApiState, file_id: str) -> None:
    """A 400 naming the limit for an input file over one: read off the event loop, and only as
    far as the first line over a limit."""
    lines, line_bytes = s.settings.max_batch_lines, s.settings.max_batch_line_bytes
    try:
        scan = await s.files.scan(file_id, lines, line_bytes)
    except FileError as err:
        raise _file_error(err) from None
    if scan.too_long is not None:
        raise ApiError(400, f"input_file_id: line {scan.too_long + 1} of file {file_id} is longer than "
                            f"{line_bytes} bytes, the limit for one request (SLUICE_MAX_BATCH_LINE_BYTES)",
                       param="input_file_id")
    if scan.lines > lines:
        raise ApiError(400, f"input_file_id: file {file_id} has more than {lines} requests, the limit for "
                            "one batch (SLUICE_MAX_BATCH_LINES)", param="input_file_id")


@router.get("/batches")
async def list_batches(limit: int = Query(20, ge=1, le=100), after: str | None = None,
                       s: ApiState = Depends(state), caller: Caller = Depends(require_key)) -> dict:
    return _page(await s.jobs.list(limit + 1, after, owner=caller.lists), limit)


async def _batch(s: ApiState, caller: Caller, batch_id: str) -> dict[str, Any]:
    """A batch the caller may see; another key's batch is as missing as an unknown id."""
    found = await s.jobs.get(batch_id)
    if found is None or (not caller.admin and not caller.owns(await s.jobs.owner(batch_id))):
        raise ApiError(404, f"batch {batch_id!r} not found", code="not_found")
    return found


@router.get("/batches/{batch_id}")
async def get_batch(batch_id: str, s: ApiState = Depends(state),
                    caller: Caller = Depends(require_key)) -> dict[str, Any]:
    return await _batch(s, caller, batch_id)


@router.post("/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, s: ApiState = Depends(state),
                       caller: Caller = Depends(require_key)) -> dict[str, Any]:
    """The batch in its real status: `cancelling` while its runner stops it, `cancelled` if no
    runner had started it, and unchanged once it is finalizing or final."""
    await _batch(s, caller, batch_id)
    found = await s.jobs.request_cancel(batch_id)
    if found is None:
        raise ApiError(404, f"batch {batch_id!r} not found", code="not_found")
    return found
