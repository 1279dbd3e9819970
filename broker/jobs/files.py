"""Files (OpenAI Files API): content in a local folder, metadata in Redis (`sluice:file:<id>`),
listed through one index (`sluice:files`, ids by expiry time): no SCAN or multi-key read
across slots, so it works on a Redis Cluster as on one server."""

from __future__ import annotations

import asyncio
import io
import json
import os
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from redis.asyncio import Redis

from sluice.broker.jobs.tenant_files import TenantFiles
from sluice.broker.keys import PREFIX, tenant_index
from sluice.broker.plumbing import members, newest_first
from sluice.protocol.ids import new_file_id

PURPOSES = ("batch", "batch_output")
_CHUNK = 1024 * 1024
# How long a file on disk must be left alone before the sweep may take it: a complete one gets
# its metadata milliseconds after its rename; an upload in progress touches its .part constantly.
_FILE_IDLE_S = 60.0
_PART_IDLE_S = 600.0
_LONGEST_TTL_S = 30 * 86400  # the longest expires_after an upload may name


def read_lines(source: BinaryIO, max_line_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """The non-blank lines of `source` as (index, bytes), read in chunks: a line over
    `max_line_bytes` comes as (index, None) and is never held whole. `index` is the line's
    0-based position (blank lines counted); lines end at b"\\n" only (JSON Lines)."""
    index, line, over, told, blank = 0, bytearray(), False, False, True
    while chunk := source.read(_CHUNK):
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            piece = chunk[start:] if end < 0 else chunk[start:end]
            blank = blank and not piece.strip()
            if not over and len(line) + len(piece) > max_line_bytes:
                over, line = True, bytearray()
            elif not over:
                line += piece
            if over and not blank and not told:  # said at once: a reader may stop here
                told = True
                yield index, None
            if end < 0:
                break
            if not blank and not over:
                yield index, bytes(line)
            index, line, over, told, blank, start = index + 1, bytearray(), False, False, True, end + 1
    if not blank and not over:
        yield index, bytes(line)


@dataclass(frozen=True)
class LineScan:
    """What a batch input file holds, as far as its limits: `lines` counts its non-blank lines
    up to `max_lines` + 1; `too_long` is the index of its first line over the byte limit."""

    lines: int
    too_long: int | None


def scan_lines(source: BinaryIO, max_lines: int, max_line_bytes: int) -> LineScan:
    """Stops at the first line over either limit: bounded time and memory whatever the file."""
    lines = 0
    for index, line in read_lines(source, max_line_bytes):
        if line is None:
            return LineScan(lines, index)
        lines += 1
        if lines > max_lines:
            break
    return LineScan(lines, None)


class FileError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _key(file_id: str) -> str:
    return f"{PREFIX}:file:{file_id}"


_INDEX = f"{PREFIX}:files"  # every file id by creation time


def _owned(owner: str) -> str:
    """The files one key made, by creation time: its listing and its quota read only them."""
    return f"{PREFIX}:files:by:{owner}"



class FileStore:
    """`ttl_s`: how long a file is kept when its upload names no `expires_after` (OpenAI's
    default for batch files is 30 days). The metadata key carries the TTL; the content on disk
    goes with it, by the sweep that creating a file runs when it is due. File I/O runs in a
    thread, never on the event loop, and an upload is copied to disk in chunks."""

    def __init__(self, redis: Redis, root: Path, max_bytes: int, ttl_s: int = 30 * 86400,
                 max_files: int | None = None):
        """`max_files`: how many files one key may keep (its uploads are refused past it)."""
        self.redis = redis
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.max_files = max_files
        self.sweep_every_s = min(600.0, ttl_s / 2)
        self.tenant_files = TenantFiles(redis, _key)  # each tenant's stored files, for its limits
        self._next_sweep = 0.0

    def path(self, file_id: str) -> Path:
        return self.root / file_id

    async def create(self, filename: str, purpose: str, data: bytes,
                     owner: str | None = None, expires_after_s: int | None = None) -> dict[str, Any]:
        return await self.create_from(filename, purpose, io.BytesIO(data), owner, expires_after_s)

    async def create_from(self, filename: str, purpose: str, source: BinaryIO,
                          owner: str | None = None, expires_after_s: int | None = None,
                          upload: bool = False, tenant: str | None = None,
                          tenant_limits: tuple[int | None, int | None] = (None, None)) -> dict[str, Any]:
        """`owner`: the digest of the api key that made it (the api leaves it out of answers).
        `source` is read in chunks: an upload is never whole in memory. An `upload` counts
        against its owner's `max_files` (a job's output files do not), and its tenant's
        `tenant_limits` (max_files, max_file_bytes), checked atomically once its size is known."""
        if purpose not in PURPOSES:
            raise FileError(400, f"purpose: must be one of {', '.join(PURPOSES)}, not {purpose!r}")
        if upload and owner and self.max_files is not None and await self._kept(owner) >= self.max_files:
            raise FileError(400, f"file: this key keeps {self.max_files} files, the most it may "
                                 "(SLUICE_MAX_FILES_PER_KEY): delete some first")
        file_id = new_file_id()
        size = await asyncio.to_thread(self._write, file_id, source, purpose == "batch")
        ttl = expires_after_s or self.ttl_s
        now = int(time.time())
        if upload and tenant and any(tenant_limits):
            over = await self.tenant_files.record(tenant, file_id, size, now + ttl,
                                                  max_files=tenant_limits[0], max_bytes=tenant_limits[1])
            if over:
                await asyncio.to_thread(self.path(file_id).unlink, missing_ok=True)
                limit = tenant_limits[0] if over == "max_files" else tenant_limits[1]
                raise FileError(429, f"tenant {tenant!r} is over its {over} limit ({limit}): delete some "
                                     "of its files first")
        meta = {"id": file_id, "object": "file", "bytes": size, "created_at": now, "expires_at": now + ttl,
                "filename": filename, "purpose": purpose, "status": "processed", "owner": owner}
        if tenant:
            meta["tenant"] = tenant
        await self.redis.set(_key(file_id), json.dumps(meta), ex=ttl)
        # Scored to the microsecond: listed in the order they were made. An index outlives
        # every file it lists, no longer; past the longest retention its ids are trimmed, and
        # ids of files gone before are dropped as listings and the quota read them.
        longest = max(self.ttl_s, _LONGEST_TTL_S, ttl)
        async with self.redis.pipeline(transaction=False) as pipe:
            for index in [_INDEX, *(_owned(o) for o in (owner, tenant and tenant_index(tenant)) if o)]:
                pipe.zadd(index, {file_id: time.time()})
                pipe.zremrangebyscore(index, "-inf", now - longest)
                pipe.expire(index, longest)
            await pipe.execute()
        if time.monotonic() >= self._next_sweep:
            self._next_sweep = time.monotonic() + self.sweep_every_s
            await self.sweep()
        return meta

    def _write(self, file_id: str, source: BinaryIO, needs_content: bool) -> int:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.path(file_id).with_suffix(".part")
        size, blank = 0, True
        try:
            with tmp.open("wb") as out:
                while chunk := source.read(_CHUNK):
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise FileError(413, f"file: over the limit of {self.max_bytes} bytes")
                    blank = blank and not chunk.strip()
                    out.write(chunk)
            if needs_content and blank:
                raise FileError(400, "file: empty")
            tmp.rename(self.path(file_id))  # whole or absent, never half-written
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return size

    async def sweep(self) -> list[str]:
        """Remove the content of files whose metadata expired (or never came: an api stopped
        mid-upload). Only files left alone a while: one just written gets its metadata next."""
        names = await asyncio.to_thread(self._idle_names)
        if not names:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.exists(_key(name))
            known = await pipe.execute()
        gone = [n for n, k in zip(names, known) if n.endswith(".part") or not k]

        def unlink_gone() -> None:
            for name in gone:
                self.path(name).unlink(missing_ok=True)

        await asyncio.to_thread(unlink_gone)
        return gone

    def _idle_names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        now = time.time()
        return [p.name for p in self.root.iterdir()
                if now - p.stat().st_mtime > (_PART_IDLE_S if p.suffix == ".part" else _FILE_IDLE_S)]

    async def get(self, file_id: str) -> dict[str, Any]:
        raw = await self.redis.get(_key(file_id))
        if raw is None or not await asyncio.to_thread(self.path(file_id).is_file):
            raise FileError(404, f"file {file_id!r} not found")
        return json.loads(raw)

    async def content(self, file_id: str) -> bytes:
        await self.get(file_id)
        return await asyncio.to_thread(self.path(file_id).read_bytes)

    async def open(self, file_id: str) -> BinaryIO:
        """The file's content to read from disk (the caller closes it); once open, it stays
        readable whole even if the file is deleted meanwhile."""
        await self.get(file_id)
        try:
            return await asyncio.to_thread(self.path(file_id).open, "rb")
        except FileNotFoundError:
            raise FileError(404, f"file {file_id!r} not found") from None

    async def stream(self, file_id: str) -> tuple[int, AsyncIterator[bytes]]:
        """The file's size and its content in chunks read off the event loop: never whole in
        memory. The file is open from here; the chunks' end (or their close) closes it."""
        source = await self.open(file_id)
        size = os.fstat(source.fileno()).st_size

        async def chunks() -> AsyncIterator[bytes]:
            try:
                while chunk := await asyncio.to_thread(source.read, _CHUNK):
                    yield chunk
            finally:
                source.close()

        return size, chunks()

    async def scan(self, file_id: str, max_lines: int, max_line_bytes: int) -> LineScan:
        """The file's lines against a batch's limits, read off the event loop."""
        with await self.open(file_id) as source:
            return await asyncio.to_thread(scan_lines, source, max_lines, max_line_bytes)

    async def list(self, purpose: str | None = None, *, owner: str | None = None, after: str | None = None,
                   limit: int = 10_000) -> list[dict[str, Any]]:
        """Newest first, at most `limit`, from after the file `after`; with `owner`, only the
        files that key made, read from its own index (a listing costs its page, not every
        file's metadata)."""
        index = _owned(owner) if owner else _INDEX
        found, gone = await newest_first(self.redis, index, after, limit,
                                         lambda pipe, fid: pipe.get(_key(fid)),
                                         lambda raw: purpose in (None, json.loads(raw)["purpose"]))
        if gone:
            await self.redis.zrem(index, *gone)
        return [json.loads(raw) for raw in found]

    async def _kept(self, owner: str) -> int:
        """How many files `owner` keeps: its index, less the ids of files gone (dropped here,
        so the count is exact and the index holds at most about max_files ids)."""
        index = _owned(owner)
        count = await self.redis.zcard(index)
        if count < (self.max_files or 0):
            return count
        ids = members(await self.redis.zrange(index, 0, -1))
        async with self.redis.pipeline(transaction=False) as pipe:
            for file_id in ids:
                pipe.exists(_key(file_id))
            alive = await pipe.execute()
        gone = [i for i, a in zip(ids, alive) if not a]
        if gone:
            await self.redis.zrem(index, *gone)
        return len(ids) - len(gone)

    async def delete(self, file_id: str) -> None:
        meta = await self.get(file_id)
        await self.redis.delete(_key(file_id))
        await self.redis.zrem(_INDEX, file_id)
        for o in (meta.get("owner"), meta.get("tenant") and tenant_index(meta["tenant"])):
            if o:
                await self.redis.zrem(_owned(o), file_id)
        if meta.get("tenant"):
            await self.tenant_files.forget(meta["tenant"], file_id)
        await asyncio.to_thread(self.path(file_id).unlink, missing_ok=True)
