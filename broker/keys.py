"""Redis key names. All keys of one model share the hash tag {m:<model>} (one cluster slot)."""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass

PREFIX = "sluice"
GROUP = "workers"
MODELS = f"{PREFIX}:models"
WORKERS = f"{PREFIX}:workers"
# Pub/sub channel announcing request ids whose final result was just written.
DONE_CHANNEL = f"{PREFIX}:done"


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


def idempotency(key: str) -> str:
    return f"{PREFIX}:idem:{key}"


@dataclass(frozen=True)
class ModelKeys:
    model: str

    @property
    def tag(self) -> str:
        return f"{PREFIX}:{{m:{self.model}}}"

    @property
    def requests(self) -> str:
        return f"{self.tag}:req"

    @property
    def bulk(self) -> str:
        return f"{self.tag}:bulk"

    @property
    def dead_letters(self) -> str:
        return f"{self.tag}:dlq"

    @property
    def log(self) -> str:
        return f"{self.tag}:log"

    def reply(self, rid: str) -> str:
        return f"{self.tag}:reply:{rid}"

    def status(self, rid: str) -> str:
        return f"{self.tag}:status:{rid}"

    def cancel(self, rid: str) -> str:
        return f"{self.tag}:cancel:{rid}"

    def consumer_lock(self, consumer: str) -> str:
        return f"{self.tag}:consumer:{consumer}"
