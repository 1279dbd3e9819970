"""The ids Sluice makes, in one place: requests, files, batches, and the OpenAI ids derived
from a request id (a completion's and a batch output line's, so a retry repeats them)."""

from __future__ import annotations

import re
import time
import uuid

_RID = re.compile(r"req-(\d{13})-[0-9a-f]{32}")


def new_request_id() -> str:
    """`req-<unix ms>-<uuid>`: the creation time lets the api tell a result that expired (410)
    from an id that never existed (404) once the status hash is gone."""
    return f"req-{time.time_ns() // 1_000_000}-{uuid.uuid4().hex}"


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
