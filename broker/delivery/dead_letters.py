"""The dead-letter stream of a model (one per shard of a sharded model: a request's dead letter
is written in its own slot): list, retry (re-enqueue) and drop requests in it."""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import ValidationError
from redis.asyncio import Redis

from sluice.broker.keys import GROUP, ModelKeys
from sluice.broker.plumbing import Scripts
from sluice.protocol.messages import RequestMessage

if TYPE_CHECKING:
    from sluice.broker.delivery.consumer import StreamConsumer

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
    def __init__(self, redis: Redis, model: str, *, status_ttl_s: int = 86400, bulk_queue_share: float = 0.5,
                 shards: int = 1, result_ttl_s: int = 3600):
        self.redis = redis
        self.keys = ModelKeys(model)
        self.shards = shards
        self.streams = [k.dead_letters for k in self.keys.shards(shards)]
        self.scripts = Scripts.register(redis)
        self.status_ttl_s = status_ttl_s
        self.result_ttl_s = result_ttl_s  # the model's retention: a retried result's, where its status expired
        self.bulk_queue_share = bulk_queue_share

    async def list(self, count: int = 1000) -> list[DeadLetter]:
        entries = [e for stream in self.streams for e in await self.redis.xrange(stream, count=count)]
        return [self._letter(eid, f) for eid, f in sorted(entries, key=lambda e: _order(e[0]))[:count]]

    async def recent(self, count: int = 10) -> tuple[int, list[DeadLetter]]:
        """How many letters the streams hold, and the newest `count` of them, newest first."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for stream in self.streams:
                pipe.xlen(stream)
                pipe.xrevrange(stream, count=count)
            got = await pipe.execute()
        entries = sorted((e for found in got[1::2] for e in found), key=lambda e: _order(e[0]), reverse=True)
        return sum(got[::2]), [self._letter(eid, f) for eid, f in entries[:count]]

    def _letter(self, eid: str, f: dict[str, str]) -> DeadLetter:
        return DeadLetter(eid, f.get("id", ""), f.get("error", ""), int(f.get("attempts", 0)),
                          float(f.get("failed_at", 0)), f.get("stream", self.keys.requests),
                          _message(f.get("data", "")), f.get("data", ""))

    async def _select(self, request_ids: list[str] | None) -> list[DeadLetter]:
        letters = await self.list(count=100_000)
        if request_ids is None:
            return letters
        wanted = set(request_ids)
        return [d for d in letters if d.request_id in wanted]

    async def retry(self, request_ids: list[str] | None, *, max_queued: int) -> list[str]:
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
            lane_max = max(int(max_queued * self.bulk_queue_share), 1) if bulk else -(-max_queued // self.shards)
            shard = self.keys.for_request(d.request_id)  # the request's slot: its stream and dead letters
            entry = await self.scripts.requeue(
                keys=[d.stream, shard.status(d.request_id), shard.reply(d.request_id),
                      shard.dead_letters, shard.requests if bulk else shard.bulk],
                args=[max_queued, d.request_id, msg.model_dump_json(), now, self.status_ttl_s, d.entry_id,
                      lane_max, msg.model, msg.lane, msg.owner or "", self.result_ttl_s, uuid.uuid4().hex],
            )
            if entry == "":
                log.warning("dead letter %s (request %s) is gone: retried or dropped already", d.entry_id,
                            d.request_id)
                continue
            if entry is None:
                log.warning("the stream of %s is full: the other dead letters stay", self.keys.model)
                break
            retried.append(d.request_id)
        return retried

    async def drop(self, request_ids: list[str] | None) -> list[str]:
        letters = await self._select(request_ids)
        for stream in self.streams:
            mine = [d.entry_id for d in letters if self.keys.for_request(d.request_id).dead_letters == stream]
            if mine:
                await self.redis.xdel(stream, *mine)
        return [d.request_id for d in letters]


async def unreadable(consumer: StreamConsumer, stream: str, entry_id: str, fields: dict[str, str],
                     err: Exception) -> None:
    """An entry that does not parse still ends: `failed`, naming why, found by the request id
    stored beside the payload; the raw payload goes to the dead-letter stream."""
    c = consumer
    rid = fields.get("id")
    error = f"the request could not be read by worker {c.consumer}: {type(err).__name__}: {err}"[:2000]
    log.error("entry %s on %s (request %s) cannot be read: %s", entry_id, stream, rid, err)
    if rid:
        await c.dead_letter(stream, entry_id, rid, fields.get("data", ""), error, 1)
    else:  # nobody to tell: keep it for the operator, off the stream
        await c.redis.xadd(c.keys.dead_letters, {"id": "", "data": json.dumps(fields), "error": error},
                           maxlen=c.limits.dlq_max_len, approximate=True)
        await c.redis.xack(stream, GROUP, entry_id)
        await c.redis.xdel(stream, entry_id)


def _order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _message(data: str) -> RequestMessage | None:
    try:
        return RequestMessage.model_validate_json(data)
    except ValidationError:
        return None
