"""Files and batches in the OpenAI Batch API format; jobs run on Celery workers (`sluice jobs`)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, File, Form, Query, UploadFile
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from sluice.api.errors import ApiError
from sluice.api.state import ApiState, state
from sluice.broker.batches import ENDPOINTS, JOB_QUEUE, JOB_TASK
from sluice.broker.files import FileError

router = APIRouter(prefix="/v1", tags=["files and batches"])


def _file_error(err: FileError) -> ApiError:
    return ApiError(err.status, str(err), code="not_found" if err.status == 404 else "invalid_request_error")


@router.post("/files")
async def upload(file: UploadFile = File(...), purpose: str = Form(...), s: ApiState = Depends(state)) -> dict:
    data = await file.read()
    try:
        return await s.files.create(file.filename or "upload.jsonl", purpose, data)
    except FileError as err:
        raise _file_error(err) from None


@router.get("/files")
async def list_files(purpose: str | None = None, s: ApiState = Depends(state)) -> dict:
    return {"object": "list", "data": await s.files.list(purpose)}


@router.get("/files/{file_id}")
async def get_file(file_id: str, s: ApiState = Depends(state)) -> dict:
    try:
        return await s.files.get(file_id)
    except FileError as err:
        raise _file_error(err) from None


@router.get("/files/{file_id}/content")
async def file_content(file_id: str, s: ApiState = Depends(state)) -> Response:
    try:
        return Response(await s.files.content(file_id), media_type="application/octet-stream")
    except FileError as err:
        raise _file_error(err) from None


@router.delete("/files/{file_id}")
async def delete_file(file_id: str, s: ApiState = Depends(state)) -> dict:
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


@router.post("/batches")
async def create_batch(body: CreateBatch, s: ApiState = Depends(state)) -> dict[str, Any]:
    if body.endpoint not in ENDPOINTS:
        raise ApiError(400, f"endpoint: must be one of {', '.join(ENDPOINTS)}", param="endpoint")
    if body.completion_window != "24h":
        raise ApiError(400, "completion_window: only '24h' is supported", param="completion_window")
    try:
        meta = await s.files.get(body.input_file_id)
    except FileError as err:
        raise _file_error(err) from None
    if meta["purpose"] != "batch":
        raise ApiError(400, f"input_file_id: file {body.input_file_id} has purpose {meta['purpose']!r}, "
                            "not 'batch'", param="input_file_id")
    batch = await s.batches.create(body.input_file_id, body.endpoint, body.completion_window, body.metadata)
    # kombu publishes synchronously: keep it off the event loop.
    await asyncio.to_thread(s.celery.send_task, JOB_TASK, [batch["id"]], queue=JOB_QUEUE)
    return batch


@router.get("/batches")
async def list_batches(limit: int = Query(20, ge=1, le=100), after: str | None = None,
                       s: ApiState = Depends(state)) -> dict:
    data = await s.batches.list(limit + 1, after)
    page = data[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(data) > limit}


async def _batch(s: ApiState, batch_id: str) -> dict[str, Any]:
    found = await s.batches.get(batch_id)
    if found is None:
        raise ApiError(404, f"batch {batch_id!r} not found", code="not_found")
    return found


@router.get("/batches/{batch_id}")
async def get_batch(batch_id: str, s: ApiState = Depends(state)) -> dict[str, Any]:
    return await _batch(s, batch_id)


@router.post("/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, s: ApiState = Depends(state)) -> dict[str, Any]:
    """The batch in its real status: `cancelling` while its runner stops it, `cancelled` if no
    runner had started it, and unchanged once it is finalizing or final."""
    found = await s.batches.request_cancel(batch_id)
    if found is None:
        raise ApiError(404, f"batch {batch_id!r} not found", code="not_found")
    return found
