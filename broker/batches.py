"""Batch jobs (OpenAI Batch API objects) kept in Redis, with what a job needs to resume:
which input line became which request, and the output records written so far."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from redis.asyncio import Redis

from sluice.broker.keys import PREFIX

# The Celery task that runs a job, and its queue (the api sends it by name).
JOB_TASK = "sluice.run_batch"
JOB_QUEUE = "sluice-jobs"
TERMINAL = frozenset({"failed", "completed", "expired", "cancelled"})
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
_TIMES = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at",
          "expired_at", "cancelling_at", "cancelled_at")
_INDEX = f"{PREFIX}:batches"

# Release a lock only if we still hold it.
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


def _key(batch_id: str, part: str = "") -> str:
    return f"{PREFIX}:batch:{batch_id}" + (f":{part}" if part else "")


class BatchStore:
    def __init__(self, redis: Redis):
        self.redis = redis
        self._release = redis.register_script(_RELEASE)

    async def create(self, input_file_id: str, endpoint: str, completion_window: str,
                     metadata: dict[str, str] | None) -> dict[str, Any]:
        batch_id = f"batch_{uuid.uuid4().hex}"
        now = int(time.time())
        fields = {"id": batch_id, "endpoint": endpoint, "input_file_id": input_file_id,
                  "completion_window": completion_window, "status": "validating", "created_at": now,
                  "expires_at": now + 24 * 3600, "total": 0, "completed": 0, "failed": 0, "output_tokens": 0,
                  "metadata": json.dumps(metadata or {})}
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(_key(batch_id), mapping=fields)
            pipe.zadd(_INDEX, {batch_id: now})
            await pipe.execute()
        return await self.get(batch_id)  # type: ignore[return-value]

    async def get(self, batch_id: str) -> dict[str, Any] | None:
        raw = await self.redis.hgetall(_key(batch_id))
        return _object(raw) if raw else None

    async def list(self, limit: int = 20, after: str | None = None) -> list[dict[str, Any]]:
        ids = await self.redis.zrevrange(_INDEX, 0, -1)
        if after in ids:
            ids = ids[ids.index(after) + 1:]
        out = []
        for batch_id in ids[:limit]:
            found = await self.get(batch_id)
            if found:
                out.append(found)
        return out

    async def unfinished(self) -> list[str]:
        ids = await self.redis.zrange(_INDEX, 0, -1)
        states = [await self.redis.hget(_key(i), "status") for i in ids]
        return [i for i, s in zip(ids, states) if s and s not in TERMINAL]

    async def update(self, batch_id: str, **fields: Any) -> None:
        """Set fields; a new status also stamps its `<status>_at` time."""
        status = fields.get("status")
        if status and f"{status}_at" in _TIMES:
            fields.setdefault(f"{status}_at", int(time.time()))
        await self.redis.hset(_key(batch_id), mapping={k: v for k, v in fields.items() if v is not None})

    async def count(self, batch_id: str, field: str, n: int = 1) -> None:
        await self.redis.hincrby(_key(batch_id), field, n)

    async def request_cancel(self, batch_id: str) -> dict[str, Any] | None:
        found = await self.get(batch_id)
        if found and found["status"] not in TERMINAL and found["status"] != "cancelling":
            await self.update(batch_id, status="cancelling")
        return await self.get(batch_id)

    # -- what a job needs to resume
    async def request_ids(self, batch_id: str) -> dict[int, str]:
        return {int(k): v for k, v in (await self.redis.hgetall(_key(batch_id, "rids"))).items()}

    async def bind(self, batch_id: str, line: int, rid: str) -> None:
        await self.redis.hset(_key(batch_id, "rids"), str(line), rid)

    async def outputs(self, batch_id: str) -> dict[int, dict[str, Any]]:
        return {int(k): json.loads(v) for k, v in (await self.redis.hgetall(_key(batch_id, "out"))).items()}

    async def record(self, batch_id: str, line: int, record: dict[str, Any]) -> bool:
        """Keep one output record per line; False if the line already had one."""
        return bool(await self.redis.hsetnx(_key(batch_id, "out"), str(line), json.dumps(record)))

    async def lock(self, batch_id: str, token: str, ttl_s: float) -> bool:
        return bool(await self.redis.set(_key(batch_id, "lock"), token, nx=True, px=int(ttl_s * 1000)))

    async def refresh_lock(self, batch_id: str, token: str, ttl_s: float) -> bool:
        key = _key(batch_id, "lock")
        if await self.redis.get(key) != token:
            return False
        return bool(await self.redis.pexpire(key, int(ttl_s * 1000)))

    async def unlock(self, batch_id: str, token: str) -> None:
        await self._release(keys=[_key(batch_id, "lock")], args=[token])


def _object(raw: dict[str, str]) -> dict[str, Any]:
    """The OpenAI Batch object."""
    obj: dict[str, Any] = {"id": raw["id"], "object": "batch", "endpoint": raw["endpoint"], "errors": None,
                           "input_file_id": raw["input_file_id"], "completion_window": raw["completion_window"],
                           "status": raw["status"], "output_file_id": raw.get("output_file_id"),
                           "error_file_id": raw.get("error_file_id")}
    for t in _TIMES:
        obj[t] = int(raw[t]) if raw.get(t) else None
    obj["request_counts"] = {k: int(raw.get(k, 0)) for k in ("total", "completed", "failed")}
    obj["metadata"] = json.loads(raw.get("metadata") or "{}")
    obj["usage"] = {"output_tokens": int(raw.get("output_tokens", 0))}
    if raw.get("error"):
        obj["errors"] = {"object": "list", "data": [{"code": "batch_failed", "message": raw["error"]}]}
    return obj
