"""The ids Sluice makes, in one place: requests, files, batches, and the OpenAI ids derived
from a request id (a completion's and a batch output line's, so a retry repeats them)."""

from __future__ import annotations

import re
import time
import uuid

_RID = re.compile(r"req-(\d{13})-[0-9a-f]{32}(?:-s(\d+))?")


def new_request_id(shard: int = 0) -> str:
    """`req-<unix ms>-<uuid>`, and `-s<k>` for a request on shard k of a sharded model (its keys
    live in that shard's slot, so the id must say which). The creation time lets the api tell
    a result that expired (410) from an id that never existed (404) once the status is gone."""
    return f"req-{time.time_ns() // 1_000_000}-{uuid.uuid4().hex}" + (f"-s{shard}" if shard else "")


def request_shard(rid: str) -> int:
    """The shard a request id was made for (0 for an unsharded model, or an id of another form)."""
    head, sep, tail = rid.rpartition("-s")
    return int(tail) if sep and tail.isdigit() and _RID.fullmatch(rid) else 0


def request_created_at(rid: str) -> float | None:
    """When a request id was made (unix seconds); None for an id of another form (older ids
    were `req-<uuid>`)."""
    found = _RID.fullmatch(rid)
    return int(found.group(1)) / 1000 if found else None


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


def completion_id(rid: str, *, chat: bool) -> str:
    """The OpenAI id of the completion that answers request `rid`."""
    return f"{'chatcmpl' if chat else 'cmpl'}-{rid.removeprefix('req-')}"


def batch_line_id(rid: str | None = None) -> str:
    """The id of a batch output line: from its request's id, or a fresh one for a line that
    never became a request (it failed validation)."""
    return f"batch_req_{rid.removeprefix('req-') if rid else uuid.uuid4().hex}"
