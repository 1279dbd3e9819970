"""Files (OpenAI Files API): content in a local folder, metadata in Redis (`sluice:file:<id>`)."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from sluice.broker.keys import PREFIX

PURPOSES = ("batch", "batch_output")


class FileError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _key(file_id: str) -> str:
    return f"{PREFIX}:file:{file_id}"


class FileStore:
    def __init__(self, redis: Redis, root: Path, max_bytes: int):
        self.redis = redis
        self.root = Path(root)
        self.max_bytes = max_bytes

    def path(self, file_id: str) -> Path:
        return self.root / file_id

    async def create(self, filename: str, purpose: str, data: bytes) -> dict[str, Any]:
        if purpose not in PURPOSES:
            raise FileError(400, f"purpose: must be one of {', '.join(PURPOSES)}, not {purpose!r}")
        if len(data) > self.max_bytes:
            raise FileError(413, f"file: {len(data)} bytes is over the limit of {self.max_bytes}")
        if purpose == "batch" and not data.strip():
            raise FileError(400, "file: empty")
        file_id = f"file-{uuid.uuid4().hex}"
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.path(file_id).with_suffix(".part")
        tmp.write_bytes(data)
        tmp.rename(self.path(file_id))  # whole or absent, never half-written
        meta = {"id": file_id, "object": "file", "bytes": len(data), "created_at": int(time.time()),
                "filename": filename, "purpose": purpose, "status": "processed"}
        await self.redis.set(_key(file_id), json.dumps(meta))
        return meta

    async def get(self, file_id: str) -> dict[str, Any]:
        raw = await self.redis.get(_key(file_id))
        if raw is None or not self.path(file_id).is_file():
            raise FileError(404, f"file {file_id!r} not found")
        return json.loads(raw)

    async def content(self, file_id: str) -> bytes:
        await self.get(file_id)
        return self.path(file_id).read_bytes()

    async def list(self, purpose: str | None = None) -> list[dict[str, Any]]:
        keys = [k async for k in self.redis.scan_iter(match=_key("*"), count=500)]
        metas = [json.loads(v) for v in await self.redis.mget(keys) if v] if keys else []
        return sorted((m for m in metas if purpose in (None, m["purpose"])), key=lambda m: m["created_at"])

    async def delete(self, file_id: str) -> None:
        await self.get(file_id)
        await self.redis.delete(_key(file_id))
        self.path(file_id).unlink(missing_ok=True)
