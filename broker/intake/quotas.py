"""Tenants' requests and tokens per minute on each model (quota.lua), as OpenAI's limits are.

Each limit is a GCRA bucket (a token bucket kept as one timestamp): `limit` units a minute, at
most a minute's worth at once, refilled continuously. It is one string per tenant, limit and
model in the model's slot, so the script that writes a request's final (write_final in
_lib.lua) settles the tokens charged at admission (prompt estimate + max_tokens) against the
tokens the request used, in that same atomic call: nothing to drift when a process dies, and the
layout runs unchanged on a Redis Cluster. A bucket expires once full; the clock is Redis's own.

What may be lost is bounded: an api that dies between the charge and the admission leaves one
call charged that never ran; its bucket refills within the minute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from redis.asyncio import Redis

from sluice.broker.intake.calls import Quota, QuotaPeek, QuotaRelease
from sluice.broker.keys import ModelKeys
from sluice.broker.plumbing import Scripts, text

LIMITS = ("requests", "tokens")


@dataclass(frozen=True)
class Bucket:
    """One limit as a call left it: OpenAI's x-ratelimit-{limit,remaining,reset}-<name>."""

    limit: int
    remaining: int
    reset_s: float  # until the bucket is full again


@dataclass(frozen=True)
class Charge:
    """A quota charge's answer. `refused`: '' (charged), 'requests', 'tokens', or 'tokens_call'
    (the call alone needs more tokens than a minute holds: never admitted)."""

    refused: str
    retry_after_s: float
    requests: Bucket | None
    tokens: Bucket | None


def prompt_estimate(text: str) -> int:
    """The tokens a prompt is charged at admission, before the engine counts them: a quarter of
    its characters, as OpenAI estimates (the final corrects it)."""
    return math.ceil(len(text) / 4)


class Quotas:
    def __init__(self, redis: Redis, *, record_ttl_s: int) -> None:
        """`record_ttl_s`: how long a charge waits for its request's final (an unfinished
        request's status lives as long)."""
        self.redis = redis
        self.record_ttl_s = record_ttl_s
        # the charges (and releases) of the calls that arrived together: one round trip
        self.charges = Scripts(redis, pipelined=True)
        self.peeks = Scripts(redis)  # a look goes alone, as soon as asked

    @staticmethod
    def per_shard(limit: int | None, shards: int) -> int:
        """A limit's part on one shard of a model (each shard is a slot of its own)."""
        return 0 if not limit else max(1, -(-limit // shards))

    async def charge(self, model: str, rids: list[str], tokens: list[int], tenant: str, *,
                     requests_per_minute: int | None, tokens_per_minute: int | None,
                     shards: int = 1) -> Charge:
        """Charge one call (its requests `rids`, each `tokens` at admission) to `tenant` on
        `model`, or refuse it charging nothing."""
        keys = ModelKeys(model).for_request(rids[0])
        rpm = self.per_shard(requests_per_minute, shards)
        tpm = self.per_shard(tokens_per_minute, shards)
        answer = await self.charges(Quota(
            requests_bucket=keys.quota(tenant, "requests"), tokens_bucket=keys.quota(tenant, "tokens"),
            records=tuple(keys.charge(r) for r in rids), request_limit=rpm, token_limit=tpm,
            record_ttl=self.record_ttl_s, tokens=tuple(tokens)))
        refused, wait_ms, rq_left, rq_reset, tk_left, tk_reset = answer
        return Charge(text(refused), int(wait_ms) / 1000,
                      Bucket(rpm, max(int(rq_left), 0), int(rq_reset) / 1000) if rpm else None,
                      Bucket(tpm, max(int(tk_left), 0), int(tk_reset) / 1000) if tpm else None)

    async def requests_wait_s(self, model: str, tenant: str, *, requests_per_minute: int,
                              shards: int = 1) -> float:
        """A look, charging nothing: how long until the tenant's requests bucket on `model` (its
        first shard) takes one more request; 0 when it would now. Only a hint: the charge decides."""
        bucket = ModelKeys(model).quota(tenant, "requests")
        tat, (seconds, micros) = await self.peeks(QuotaPeek(bucket=bucket))
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        interval = 60_000 / self.per_shard(requests_per_minute, shards)
        return max(0.0, (max(int(tat or 0), now_ms) + interval - now_ms - 60_000) / 1000)

    async def release(self, model: str, rids: list[str], tenant: str, *, requests_per_minute: int | None,
                      shards: int = 1) -> None:
        """Give back a charged call whose admission was refused."""
        keys = ModelKeys(model).for_request(rids[0])
        await self.charges(QuotaRelease(requests_bucket=keys.quota(tenant, "requests"),
                                        records=tuple(keys.charge(r) for r in rids),
                                        request_limit=self.per_shard(requests_per_minute, shards)))
