"""The files each tenant stores, against its `max_files` and `max_file_bytes` (tenant_file.lua).

One hash per tenant (keys.tenant_files): file id → `<bytes> <expires_at>`. A file is recorded
once its content is on disk, atomically against the limits; it leaves the hash when it is
deleted, when it expires, or (an api killed between the record and the metadata) when a
refusal is near and its metadata is found gone: the count is of live files, never a counter
that could drift.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from redis.asyncio import Redis

from sluice.broker.jobs.calls import TenantFile
from sluice.broker.keys import tenant_files
from sluice.broker.plumbing import Scripts, text, texts


class TenantFiles:
    def __init__(self, redis: Redis, meta_key: Callable[[str], str]) -> None:
        """`meta_key`: the key of a file's metadata (FileStore's), to find files gone."""
        self.redis = redis
        self.meta_key = meta_key
        self.scripts = Scripts(redis)

    async def record(self, tenant: str, file_id: str, size: int, expires_at: int, *,
                     max_files: int | None, max_bytes: int | None) -> str:
        """Record the file; '' when it fits the tenant's limits, else the name of the one it
        would exceed (nothing recorded)."""
        for attempt in (1, 2):
            answer = await self.scripts(TenantFile(
                key=tenant_files(tenant), file_id=file_id, size=size, expires_at=expires_at,
                max_files=max_files or 0, max_bytes=max_bytes or 0))
            refused = text(answer[0])  # {limit name or '', files, bytes}
            if not refused or attempt == 2 or not await self._drop_gone(tenant):
                return refused
        return refused

    async def _drop_gone(self, tenant: str) -> int:
        """Drop the files whose metadata is gone; how many."""
        ids = texts(await self.redis.hkeys(tenant_files(tenant)))
        if not ids:
            return 0
        async with self.redis.pipeline(transaction=False) as pipe:
            for file_id in ids:
                pipe.exists(self.meta_key(file_id))
            alive = await pipe.execute()
        gone = [i for i, a in zip(ids, alive) if not a]
        if gone:
            await self.redis.hdel(tenant_files(tenant), *gone)
        return len(gone)

    async def forget(self, tenant: str, file_id: str) -> None:
        await self.redis.hdel(tenant_files(tenant), file_id)

    async def usage(self, tenant: str) -> tuple[int, int]:
        """(files, bytes) the tenant stores, expired ones aside (the dashboard's)."""
        now, files, size = time.time(), 0, 0
        for value in (await self.redis.hgetall(tenant_files(tenant))).values():
            b, e = value.split()
            if int(e) > now:
                files, size = files + 1, size + int(b)
        return files, size
