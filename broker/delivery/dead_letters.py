"""The dead-letter stream of a model (one per shard of a sharded model: a request's dead letter
is written in its own slot): a worker moves an entry there (DeadLetterWriter); an operator lists,
retries (re-enqueues) and drops requests in it (DeadLetters)."""

from __future__ import annotations

import builtins
import json
import logging
import time
import uuid
from dataclasses import dataclass

from pydantic import ValidationError
from redis.asyncio import Redis

from sluice.broker.delivery.calls import DeadLetter as DeadLetterCall
from sluice.broker.delivery.calls import Requeue
from sluice.broker.keys import GROUP, ModelKeys
from sluice.broker.limits import ConsumerLimits
from sluice.broker.plumbing import Entry, Fields, Scripts, stream_entries
from sluice.broker.webhooks import SubscribedOwners
from sluice.protocol.messages import RequestMessage

log = logging.getLogger(__name__)


@dataclass
class DeadLetter:
    entry_id: str
    request_id: str
    error: str
    attempts: int
    failed_at: float
    stream: str
    message: RequestMessage | None  # None: the entry could not be read (kept raw in `data`)
    data: str = ""


class DeadLetters:
    def __init__(self, redis: Redis, model: str, *, status_ttl_s: int = 86400,
                 bulk_queue_share: float = 0.5, shards: int = 1, result_ttl_s: int = 3600):
        self.redis = redis
        self.keys = ModelKeys(model)
        self.shards = shards
        self.streams = [k.dead_letters for k in self.keys.shards(shards)]
        self.scripts = Scripts(redis)
        self.status_ttl_s = status_ttl_s
        # the model's retention: a retried result's, where its status expired
        self.result_ttl_s = result_ttl_s
        self.bulk_queue_share = bulk_queue_share

    async def list(self, count: int = 1000) -> builtins.list[DeadLetter]:
        found = [entry for stream in self.streams
                 for entry in stream_entries(await self.redis.xrange(stream, count=count))]
        return [self._letter(eid, f) for eid, f in sorted(found, key=lambda e: _order(e[0]))[:count]]

    async def recent(self, count: int = 10) -> tuple[int, builtins.list[DeadLetter]]:
        """How many letters the streams hold, and the newest `count` of them, newest first."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for stream in self.streams:
                pipe.xlen(stream)
                pipe.xrevrange(stream, count=count)
            got = await pipe.execute()
        found: builtins.list[Entry] = [e for answer in got[1::2] for e in stream_entries(answer)]
        newest = sorted(found, key=lambda e: _order(e[0]), reverse=True)
        return sum(got[::2]), [self._letter(eid, f) for eid, f in newest[:count]]

    def _letter(self, eid: str, f: Fields) -> DeadLetter:
        return DeadLetter(eid, f.get("id", ""), f.get("error", ""), int(f.get("attempts", 0)),
                          float(f.get("failed_at", 0)), f.get("stream", self.keys.requests),
                          _message(f.get("data", "")), f.get("data", ""))

    async def _select(self, request_ids: builtins.list[str] | None) -> builtins.list[DeadLetter]:
        letters = await self.list(count=100_000)
        if request_ids is None:
            return letters
        wanted = set(request_ids)
        return [d for d in letters if d.request_id in wanted]

    async def retry(self, request_ids: builtins.list[str] | None, *, max_queued: int) -> builtins.list[str]:
        """Put requests back on their stream as new deliveries (a fresh deadline of the same
        length), within the stream's bound; their status returns to queued (whole again, with
        its owner, model, lane and retention, where it expired meanwhile) and their old reply
        stream is cleared. Letters that cannot be read are left for `drop`; a letter gone
        meanwhile (retried or dropped already: a second retry, a stale listing) is not retried
        again."""
        retried = []
        for d in await self._select(request_ids):
            if d.message is None:
                log.warning("dead letter %s cannot be read: not retried", d.entry_id)
                continue
            now = time.time()
            msg = d.message.model_copy(update={
                "enqueued_at": now, "deadline": now + (d.message.deadline - d.message.enqueued_at)})
            bulk = d.stream == self.keys.bulk
            if bulk:
                lane_max = max(int(max_queued * self.bulk_queue_share), 1)
            else:
                lane_max = -(-max_queued // self.shards)
            shard = self.keys.for_request(d.request_id)  # the request's slot: its stream and dead letters
            entry = await self.scripts(Requeue(
                stream=d.stream, status=shard.status(d.request_id), reply=shard.reply(d.request_id),
                dlq=shard.dead_letters, other=shard.requests if bulk else shard.bulk, max_queued=max_queued,
                rid=d.request_id, data=msg.model_dump_json(), now=now, status_ttl=self.status_ttl_s,
                letter=d.entry_id, lane_max=lane_max, model=msg.model, lane=msg.lane, owner=msg.owner or "",
                retain_s=self.result_ttl_s, nonce=uuid.uuid4().hex))
            if entry == "":
                log.warning("dead letter %s (request %s) is gone: retried or dropped already", d.entry_id,
                            d.request_id)
                continue
            if entry is None:
                log.warning("the stream of %s is full: the other dead letters stay", self.keys.model)
                break
            retried.append(d.request_id)
        return retried

    async def drop(self, request_ids: builtins.list[str] | None) -> builtins.list[str]:
        letters = await self._select(request_ids)
        for stream in self.streams:
            mine = [d.entry_id for d in letters if self.keys.for_request(d.request_id).dead_letters == stream]
            if mine:
                await self.redis.xdel(stream, *mine)
        return [d.request_id for d in letters]


class DeadLetterWriter:
    """A worker's side: an entry that used up its deliveries, or cannot be read, moved to its
    request's dead-letter stream, its client told it failed (dead_letter.lua). `written`: a
    running total, for the worker's metrics."""

    def __init__(self, redis: Redis, scripts: Scripts, keys: ModelKeys, limits: ConsumerLimits) -> None:
        self.redis, self.scripts, self.keys, self.limits = redis, scripts, keys, limits
        self.webhook_owners = SubscribedOwners(redis)  # a dead letter whose status expired keeps its event
        self.written = 0

    async def write(self, consumer: str, stream: str, entry_id: str, rid: str, data: str, error: str,
                    attempts: int, message: RequestMessage | None = None) -> bool:
        """Whether it was dead-lettered (not: final already, or `consumer` fenced out). `message`:
        the request (None: its entry cannot be read), whose owner, model, lane, age and webhook
        mark a status that expired meanwhile gets back with its failed final."""
        model = lane = owner = hook = ""  # unknown for an entry that cannot be read
        enqueued_at: float | str = ""
        if message is not None:
            model, lane, owner = message.model, message.lane, message.owner or ""
            enqueued_at = message.enqueued_at
            hook = await self.webhook_owners.mark(message.owner, message.lane)
        shard = self.keys.for_request(rid)
        written = await self.scripts(DeadLetterCall(
            stream=stream, dlq=shard.dead_letters, status=self.keys.status(rid), reply=self.keys.reply(rid),
            group=GROUP, consumer=consumer, entry_id=entry_id, rid=rid, data=data, err=error,
            attempts=attempts, now=time.time(), result_ttl=self.limits.result_ttl_s,
            reply_ttl=self.limits.reply_ttl_s, done_channel=shard.done, dlq_max_len=self.limits.dlq_max_len,
            model=model, lane=lane, owner=owner, enqueued_at=enqueued_at, hook=hook))
        if written == 1:
            self.written += 1
            log.error("request %s moved to the dead-letter stream: %s", rid, error)
        return written == 1

    async def unreadable(self, consumer: str, stream: str, entry_id: str, fields: Fields,
                         err: Exception) -> None:
        """An entry that does not parse still ends: `failed`, naming why, found by the request id
        stored beside the payload; the raw payload goes to the dead-letter stream."""
        rid = fields.get("id")
        error = f"the request could not be read by worker {consumer}: {type(err).__name__}: {err}"[:2000]
        log.error("entry %s on %s (request %s) cannot be read: %s", entry_id, stream, rid, err)
        if rid:
            await self.write(consumer, stream, entry_id, rid, fields.get("data", ""), error, 1)
        else:  # nobody to tell: keep it for the operator, off the stream
            await self.redis.xadd(self.keys.dead_letters,
                                  {"id": "", "data": json.dumps(fields), "error": error},
                                  maxlen=self.limits.dlq_max_len, approximate=True)
            await self.redis.xack(stream, GROUP, entry_id)
            await self.redis.xdel(stream, entry_id)


def _order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _message(data: str) -> RequestMessage | None:
    try:
        return RequestMessage.model_validate_json(data)
    except ValidationError:
        return None
