"""The api side of a request: admit it onto its lane (bounded, idempotent, durable as configured);
its idempotency key. Cancels and status reads are intake/cancels.py and intake/status_reads.py."""

from __future__ import annotations

import json
import re

from redis.asyncio import Redis

from sluice.broker import keys
from sluice.broker.delivery import expected_cost, group_of, staged_streams
from sluice.broker.intake.calls import Admit, AdmittedRequest, Room
from sluice.broker.keys import ModelKeys
from sluice.broker.limits import AdmissionLimits, TenantShare
from sluice.broker.plumbing import Scripts, wait_for_copies
from sluice.broker.webhooks import SubscribedOwners
from sluice.protocol.messages import RequestMessage


class QueueFull(Exception):
    """The model's streams hold their bound of waiting requests (or its lane its share)."""


class TenantQueueFull(QueueFull):
    """The tenant holds its share of the model's queue bound while another tenant has work queued."""

    def __init__(self, model: str, tenant: str, held: int):
        super().__init__(model)
        self.tenant, self.held = tenant, held


TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")  # a part of key names (keys.staged)


class SloRefused(QueueFull):
    """The lane holds as many requests as can start within the model's TTFT target."""

    def __init__(self, model: str, depth: int, bound: int):
        super().__init__(model)
        self.depth, self.bound = depth, bound


class NotDurable(Exception):
    """Strict durability: the admission did not reach the disk in time (the client retries)."""


class Admission:
    def __init__(self, redis: Redis, limits: AdmissionLimits):
        self.redis = redis
        self.scripts = Scripts(redis, pipelined=True)
        self.limits = limits
        self._waitaof: bool | None = None  # whether the server has WAITAOF (Redis 7.2+), once known
        # an owner with an endpoint: its finals append events
        self.webhook_owners = SubscribedOwners(redis)

    async def submit(self, message: RequestMessage, *, max_queued: int, result_ttl_s: int | None = None,
                     slo_max: int | None = None, shards: int = 1, keyed: bool = False,
                     share: TenantShare = TenantShare()) -> str:
        """XADD the request unless the bound is reached; returns the stream entry id."""
        return (await self.submit_many([message], max_queued=max_queued, result_ttl_s=result_ttl_s,
                                       slo_max=slo_max, shards=shards, keyed=keyed, share=share))[0]

    async def submit_many(self, messages: list[RequestMessage], *, max_queued: int,
                          result_ttl_s: int | None = None, slo_max: int | None = None,
                          shards: int = 1, keyed: bool = False,
                          share: TenantShare = TenantShare()) -> list[str]:
        """XADD all the requests (one model, one lane, one owner) or none of them: they count
        against max_queued, both lanes together, and bulk against its share of it; `slo_max`
        bounds this lane further (the entries that can start within the model's TTFT target;
        SloRefused when it is what refuses them). Returns
        the stream entry ids ('' for a request that is final already). `keyed`: an
        Idempotency-Key names the requests, so each leaves its admitted mark (`was_admitted`).
        `share`: the weight and queue share of their tenant (`message.tenant`, one for all):
        TenantQueueFull when it holds its share while another tenant has work queued; with
        fair share on (the limits'), they wait their tenant's turn (docs/delivery.md).

        Idempotent on the request ids (admit.lua), so redis-py re-running the script after a
        dropped connection enqueues nothing twice. Strict durability: the admission is on
        disk before this returns (WAITAOF where the server has it; a server without it must
        run with appendfsync always, as the embedded one does in strict mode)."""
        first, limits = messages[0], self.limits
        if not TENANT_NAME.fullmatch(first.tenant):
            raise ValueError(f"tenant {first.tenant!r}: letters, digits, '.', '_' and '-', at most 64")
        keys = ModelKeys(first.model).for_request(first.id)  # one call's requests share a shard
        stream, other, lane_max, slo_max = self._bounds(keys, first.lane, max_queued, slo_max, shards)
        share_max = self._share_max(share, first.lane, max_queued, shards)
        # a job's rows have no event of their own: their batch has
        hook = first.lane != "bulk" and await self.webhook_owners.has(first.owner)
        entries = await self.scripts(Admit(
            stream=stream, other=other, statuses=tuple(keys.status(m.id) for m in messages),
            marks=tuple(keys.admitted(m.id) for m in messages) if keyed else (),
            max_queued=max_queued, lane_max=lane_max if slo_max is None else min(lane_max, slo_max),
            status_ttl=limits.status_ttl_s, now=first.enqueued_at, model=first.model, lane=first.lane,
            owner=first.owner or "", retain_s=result_ttl_s or limits.result_ttl_s,
            keep_s=limits.status_ttl_s if keyed else 0, hook="1" if hook else "", tenant=first.tenant,
            share_max=share_max, fair="1" if limits.fair_share else "", weight=share.weight,
            requests=tuple(AdmittedRequest(rid=m.id, data=m.model_dump_json(),
                                           cost=expected_cost(m) / share.weight, group=group_of(m.prefix),
                                           size=m.prefix_tokens) for m in messages)))
        if entries == "share":
            raise TenantQueueFull(first.model, first.tenant, share_max)
        if entries is None:
            # which bound refused? (a refusal may cost a read)
            if slo_max is not None and slo_max < lane_max:
                here, there = await self._queued(stream), await self._queued(other)
                if here + len(messages) <= lane_max and here + there + len(messages) <= max_queued:
                    raise SloRefused(first.model, here, slo_max)
            raise QueueFull(first.model)
        aof = limits.strict and await self._has_waitaof()
        if aof or limits.wait_replicas:
            local, copies = await wait_for_copies(self.redis, stream, replicas=limits.wait_replicas,
                                                  aof=aof, timeout_ms=limits.fsync_timeout_ms)
            if aof and local < 1:
                raise NotDurable(f"request {first.id} was not on disk within "
                                 f"{limits.fsync_timeout_ms} ms")
            if copies < limits.wait_replicas:
                raise NotDurable(f"request {first.id} was on {copies} of {limits.wait_replicas} replicas "
                                 f"(redis_wait_replicas) after {limits.fsync_timeout_ms} ms")
        return list(entries)

    def _bounds(self, keys: ModelKeys, lane: str, max_queued: int, slo_max: int | None,
                shards: int) -> tuple[str, str, int, int | None]:
        """The lane's stream, the other lane's, the lane's bound and its SLO bound on this shard."""
        stream, other = (keys.bulk, keys.requests) if lane == "bulk" else (keys.requests, keys.bulk)
        lane_max = (max(int(max_queued * self.limits.bulk_queue_share), 1) if lane == "bulk"
                    else max_queued)
        if shards > 1 and lane != "bulk":  # each shard holds its part of the bounds (one slot each)
            lane_max = -(-max_queued // shards)
            slo_max = None if slo_max is None else -(-slo_max // shards)
        return stream, other, lane_max, slo_max

    async def _queued(self, stream: str) -> int:
        """Entries queued on a lane: on its stream and staged for their tenant's turn."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in [stream, *await staged_streams(self.redis, stream)]:
                pipe.xlen(key)
            return sum(await pipe.execute())

    @staticmethod
    def _share_max(share: TenantShare, lane: str, max_queued: int, shards: int) -> int:
        """What the tenant may hold on one shard while another has work queued (an interactive
        shard holds its part of max_queued)."""
        return share.max_held(-(-max_queued // shards) if shards > 1 and lane != "bulk" else max_queued)

    async def refusal(self, model: str, shard: int, lane: str, count: int, *, max_queued: int,
                      shards: int = 1, tenant: str = "default", share: TenantShare = TenantShare()) -> str:
        """Whether `count` more requests of `tenant` would be refused now: '' (they fit), 'bound'
        or 'share' (room.lua: admit.lua's own refusal, staged entries and the tenant's share
        counted), read before any per-row work, so that a call that cannot fit is refused at
        once. Only a hint: admit.lua decides again, atomically."""
        stream, other, lane_max, _ = self._bounds(ModelKeys(model).at(shard), lane, max_queued, None,
                                                  shards)
        share_max = self._share_max(share, lane, max_queued, shards)
        return await self.scripts(Room(stream=stream, other=other, n=count, max_queued=max_queued,
                                       lane_max=lane_max, tenant=tenant, share_max=share_max))

    async def _has_waitaof(self) -> bool:
        if self._waitaof is None:
            version = (await self.redis.info("server")).get("redis_version", "0")
            self._waitaof = tuple(int(x) for x in str(version).split(".")[:2]) >= (7, 2)
        return self._waitaof

    async def claim_idempotency(self, key: str, rid: str, model: str) -> tuple[str, str] | None:
        """Bind an idempotency key to a new request; returns the (model, id) it is already bound
        to, if it is. SET NX decides which of concurrent repeats enqueues."""
        claim = keys.idempotency(key)
        bound = json.dumps({"id": rid, "model": model})
        if await self.redis.set(claim, bound, nx=True, ex=self.limits.status_ttl_s):
            return None
        first = json.loads(await self.redis.get(claim) or "null")
        return (first["model"], first["id"]) if first else None

    async def was_admitted(self, model: str, rid: str) -> bool:
        """Whether a request named by an Idempotency-Key was admitted (its mark outlives its
        result: the key's lifetime). A repeat that finds no status but this mark must not run it
        again under its id: its result expired."""
        return bool(await self.redis.exists(ModelKeys(model).admitted(rid)))

    async def release_idempotency(self, key: str) -> None:
        """Nothing was enqueued under this key: it may be used again."""
        await self.redis.delete(keys.idempotency(key))
