"""Batch jobs (OpenAI Batch API objects) kept in Redis, with what a job needs to resume:
which input line became which request, and the output records written so far.

One runner at a time holds a job's lock (a key with a TTL that the runner refreshes). Every
write a runner makes is fenced by that lock in the same Lua step, so a runner that lost it
writes nothing; every status change is conditional on the current status (job_move.lua).
"""

from __future__ import annotations

import asyncio
import builtins
import json
import time
from collections.abc import Iterable
from typing import Any

from redis.asyncio import Redis
from redis.typing import EncodableT

from sluice.broker.jobs.calls import HashField, Increment, JobCancel, JobMove, JobPut, JobRefresh, JobRelease
from sluice.broker.keys import PREFIX, tenant_index
from sluice.broker.plumbing import Scripts, hash_of, maybe_text, members, newest_first, texts
from sluice.broker.webhooks import SubscribedOwners
from sluice.broker.webhooks import outbox as webhooks
from sluice.protocol.ids import new_batch_id
from sluice.protocol.states import BatchState

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
_TIMES = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at",
          "expired_at", "cancelling_at", "cancelled_at")
_INDEX = f"{PREFIX}:batches"


def _owned(owner: str) -> str:
    """The batches one key made, by creation time: its listing reads only them."""
    return f"{PREFIX}:batches:by:{owner}"

_WINDOW_S = 24 * 3600  # the only completion window: a batch is final by created_at + this


class LockLost(Exception):
    """The runner no longer holds the job's lock: the job belongs to whoever takes it next."""


def _key(job_id: str, part: str = "") -> str:
    """The batch hash `sluice:batch:<id>`; its parts (lock, out, rids) take that whole name as
    their hash tag, so a job's scripts touch one cluster slot."""
    base = f"{PREFIX}:batch:{job_id}"
    return f"{{{base}}}:{part}" if part else base


class JobStore:
    """`ttl_s`: how long a finished batch object is kept; its rows' ids and output records only
    `result_ttl_s` (the output file has them). Every key has a TTL from its creation: a batch
    whose job never finishes goes after its window plus ttl_s, and the index forgets batches
    that old."""

    def __init__(self, redis: Redis, ttl_s: int = 30 * 86400, result_ttl_s: int = 3600):
        self.redis = redis
        self.scripts = Scripts(redis)
        self.ttl_s = ttl_s
        self.result_ttl_s = result_ttl_s
        self.lifetime_s = _WINDOW_S + ttl_s
        self.webhook_owners = SubscribedOwners(redis)  # a batch of an owner with an endpoint: `hook`

    async def create(self, input_file_id: str, endpoint: str, completion_window: str,
                     metadata: dict[str, str] | None, owner: str | None = None,
                     tenant: str | None = None) -> dict[str, Any]:
        """`owner`: the digest of the api key that made it, `tenant` that key's tenant (its rows
        are the tenant's requests); kept in the hash, not in the object. A batch is listed in its
        owner's index and its tenant's (`tenant_index`: for a tenant whose keys share)."""
        job_id = new_batch_id()
        now = int(time.time())
        fields: dict[EncodableT, EncodableT] = {
            "id": job_id, "endpoint": endpoint, "input_file_id": input_file_id,
            "completion_window": completion_window, "status": "validating", "created_at": now,
            "expires_at": now + 24 * 3600, "total": 0, "completed": 0, "failed": 0, "output_tokens": 0,
            "metadata": json.dumps(metadata or {}), "owner": owner or "", "tenant": tenant or ""}
        if await self.webhook_owners.has(owner):  # its final appends an event (job_move.lua)
            fields["hook"] = "1"
        # Not a transaction: the index is another slot. The hash is written first; a listing
        # skips an id whose hash is not there.
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(_key(job_id), mapping=fields)
            pipe.expire(_key(job_id), self.lifetime_s)
            pipe.zadd(_INDEX, {job_id: now})
            pipe.zremrangebyscore(_INDEX, "-inf", now - self.lifetime_s)
            pipe.expire(_INDEX, self.lifetime_s)
            for index in [_owned(o) for o in (owner, tenant and tenant_index(tenant)) if o]:
                # scored to the microsecond: one key's batches listed in the order it made them
                pipe.zadd(index, {job_id: time.time()})
                pipe.zremrangebyscore(index, "-inf", now - self.lifetime_s)
                pipe.expire(index, self.lifetime_s)
            await pipe.execute()
        return await self.get(job_id)  # type: ignore[return-value]

    async def get(self, job_id: str) -> dict[str, Any] | None:
        raw = hash_of(await self.redis.hgetall(_key(job_id)))
        return _object(raw) if raw else None

    async def owner(self, job_id: str) -> str | None:
        return maybe_text(await self.redis.hget(_key(job_id), "owner")) or None

    async def tenant(self, job_id: str) -> str | None:
        return maybe_text(await self.redis.hget(_key(job_id), "tenant")) or None

    async def list(self, limit: int = 20, after: str | None = None,
                   owner: str | None = None) -> builtins.list[dict[str, Any]]:
        """Newest first, at most `limit`, from after the batch `after` (from the top when it is
        not listed); with `owner`, only the batches that key made, read from its own index, so
        a listing costs its page, not everyone's batches."""
        found, _ = await newest_first(self.redis, _owned(owner) if owner else _INDEX, after, limit,
                                      lambda pipe, job_id: pipe.hgetall(_key(job_id)))
        return [_object(raw) for raw in found]  # a batch gone with its TTL is skipped

    async def active(self, limit: int = 20) -> builtins.list[dict[str, Any]]:
        """Unfinished batches, newest first, for the dashboard: bounded reads (a batch is final
        by the end of its window, so only batches created within it are looked at)."""
        since = int(time.time()) - _WINDOW_S - 3600
        ids = members(await self.redis.zrevrangebyscore(_INDEX, "+inf", since, start=0, num=1000))
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hget(_key(job_id), "status")
            states = await pipe.execute()
        running = [i for i, st in zip(ids, states) if st and not BatchState(st).final][:limit]
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id in running:
                pipe.hgetall(_key(job_id))
            found = await pipe.execute()
        return [_object(raw) for raw in found if raw]

    async def unfinished(self) -> builtins.list[str]:
        ids = members(await self.redis.zrange(_INDEX, 0, -1))
        states = [await self.redis.hget(_key(i), "status") for i in ids]
        return [i for i, s in zip(ids, states) if s and not BatchState(s).final]

    async def move(self, job_id: str, to: str, expected: Iterable[str], token: str | None = None,
                   **fields: Any) -> str:
        """Move the batch to status `to` if its status is one of `expected`, with `fields`; returns
        the status it has afterwards ('' for no such batch). With a token, the move happens only
        while that token holds the job's lock, and LockLost is raised otherwise."""
        if BatchState(to).final:
            await self._announce(job_id)
        moved, status = await self.scripts(JobMove(
            batch=_key(job_id), lock=_key(job_id, "lock"), out=_key(job_id, "out"), rids=_key(job_id, "rids"),
            to=to, expected_statuses=" ".join(expected), token=token or "", now=int(time.time()),
            retention=self.ttl_s, result_retention=self.result_ttl_s,
            fields=tuple(HashField(k, str(v)) for k, v in fields.items() if v is not None)))
        if moved == -1:
            raise LockLost(job_id)
        return status

    async def request_cancel(self, job_id: str) -> dict[str, Any] | None:
        """Cancel a batch that is being run; the answer is the batch, in its real status."""
        await self._announce(job_id)
        cancel = JobCancel(batch=_key(job_id), lock=_key(job_id, "lock"), now=int(time.time()),
                           retention=self.ttl_s)
        if await self.scripts(cancel) is None:
            return None
        return await self.get(job_id)

    async def _announce(self, job_id: str) -> None:
        """Before a move that may make a batch with the `hook` mark final: its id in the senders'
        index (webhooks.BATCHES), so they find the event the script appends to the batch's own
        outbox (another slot than the index's: written first, so a crash between the two leaves an
        id without an event, which the senders drop, never an event nobody finds)."""
        if await self.redis.hget(_key(job_id), "hook"):
            async with self.redis.pipeline(transaction=True) as pipe:  # one slot: webhooks.TAG
                pipe.zadd(webhooks.BATCHES, {job_id: time.time()})
                pipe.expire(webhooks.BATCHES, self.lifetime_s)
                await pipe.execute()

    # -- what a job needs to resume, written only by the runner holding the lock
    async def request_ids(self, job_id: str) -> dict[int, str]:
        return {int(k): v for k, v in hash_of(await self.redis.hgetall(_key(job_id, "rids"))).items()}

    async def bind(self, job_id: str, token: str, line: int, rid: str) -> None:
        """Bind a line to its request id (once: a line keeps the id it was first given)."""
        await self._put(job_id, token, "rids", line, rid, {})

    async def recorded(self, job_id: str) -> set[int]:
        """The lines that have their output record."""
        return {int(k) for k in texts(await self.redis.hkeys(_key(job_id, "out")))}

    async def records(self, job_id: str, lines: builtins.list[int]) -> builtins.list[dict[str, Any]]:
        """The output records of these lines (each has one), in their order."""
        raws = await self.redis.hmget(_key(job_id, "out"), [str(i) for i in lines]) if lines else []
        return [json.loads(raw) for raw in raws if raw is not None]

    async def outputs(self, job_id: str) -> dict[int, dict[str, Any]]:
        outputs = hash_of(await self.redis.hgetall(_key(job_id, "out")))
        return {int(k): json.loads(v) for k, v in outputs.items()}

    async def record(self, job_id: str, token: str, line: int, record: dict[str, Any],
                     counts: dict[str, int]) -> bool:
        """Keep one output record per line and add `counts` to the batch's counters with it;
        False if the line already had one."""
        return await self._put(job_id, token, "out", line, json.dumps(record), counts)

    async def _put(self, job_id: str, token: str, part: str, line: int, value: str,
                   counts: dict[str, int]) -> bool:
        written = await self.scripts(JobPut(
            lock=_key(job_id, "lock"), hash=_key(job_id, part), batch=_key(job_id), token=token,
            field=str(line), value=value, ttl=self.lifetime_s,
            counters=tuple(Increment(counter, by) for counter, by in counts.items())))
        if written == -1:
            raise LockLost(job_id)
        return bool(written)

    # -- the job's lock
    async def lock(self, job_id: str, token: str, ttl_s: float) -> bool:
        return bool(await self.redis.set(_key(job_id, "lock"), token, nx=True, px=int(ttl_s * 1000)))

    async def refresh_lock(self, job_id: str, token: str, ttl_s: float) -> bool:
        return bool(await self.scripts(JobRefresh(lock=_key(job_id, "lock"), token=token,
                                                  ttl_ms=int(ttl_s * 1000))))

    async def holds_lock(self, job_id: str, token: str) -> bool:
        return await self.redis.get(_key(job_id, "lock")) == token

    async def unlock(self, job_id: str, token: str) -> None:
        await self.scripts(JobRelease(lock=_key(job_id, "lock"), token=token))

    async def runner_alive(self, job_id: str, poll_s: float = 0.1) -> bool:
        """Whether a live runner holds the job's lock.

        A killed runner's lock outlives it by up to one TTL, so a held lock is watched: if it
        lapses, its runner is gone; if it is refreshed (its expiry, in Redis's own clock, moves
        on), still held past the expiry it had when first seen, or taken by another runner, a
        runner is alive. A live runner refreshes its lock at least once a second
        (workers/jobs/lock.py), so it is told from a dead one in about that, whatever the TTL.
        """
        key = _key(job_id, "lock")
        holder, ttl_ms, expiry = await self._lock_held(key)
        if holder is None:
            return False
        deadline = time.monotonic() + max(ttl_ms, 0) / 1000 + poll_s
        while time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
            now, _, now_expiry = await self._lock_held(key)
            if now != holder:
                return now is not None
            if now_expiry > expiry:
                return True
        return True

    async def _lock_held(self, key: str) -> tuple[str | None, int, int]:
        """The lock's holder, its TTL and its absolute expiry (ms, Redis's clock), read at once."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.get(key)
            pipe.pttl(key)
            pipe.pexpiretime(key)
            holder, ttl_ms, expiry = await pipe.execute()
        return holder, int(ttl_ms), int(expiry)


def _object(raw: dict[str, str]) -> dict[str, Any]:
    """The OpenAI Batch object."""
    obj: dict[str, Any] = {"id": raw["id"], "object": "batch", "endpoint": raw["endpoint"], "errors": None,
                           "input_file_id": raw["input_file_id"],
                           "completion_window": raw["completion_window"], "status": raw["status"],
                           "output_file_id": raw.get("output_file_id"),
                           "error_file_id": raw.get("error_file_id")}
    for t in _TIMES:
        obj[t] = int(raw[t]) if raw.get(t) else None
    obj["request_counts"] = {k: int(raw.get(k, 0)) for k in ("total", "completed", "failed")}
    obj["metadata"] = json.loads(raw.get("metadata") or "{}")
    obj["usage"] = {"output_tokens": int(raw.get("output_tokens", 0))}
    if raw.get("error"):
        obj["errors"] = {"object": "list", "data": [{"code": "batch_failed", "message": raw["error"]}]}
    return obj
