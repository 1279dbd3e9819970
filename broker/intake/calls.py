"""The typed calls of the intake wing's scripts (broker/plumbing/scripts.py: one frozen dataclass
per script, its KEYS then its ARGV in order, named as the script binds them)."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.broker.plumbing import CallPart, Key, KeyList, Parts, ScriptCall, Spread


@dataclass(frozen=True)
class AdmittedRequest(CallPart):
    """One request's part of an admit.lua call (its ARGV five)."""

    rid: str
    data: str  # the RequestMessage's JSON
    cost: float  # its expected tokens over its tenant's weight
    group: str  # its prefix group ('' for none)
    size: int  # its prompt's tokens in a prefix cache (prefix_tokens)


@dataclass(frozen=True)
class Admit(ScriptCall):
    """admit.lua: admit one call's requests onto a lane (or its tenant's staging), or none."""

    script = "admit"
    stream: Key
    other: Key  # the other lane's stream
    statuses: KeyList  # one status hash per request
    marks: KeyList  # with keep_s > 0: one admitted mark per request
    max_queued: int
    lane_max: int
    status_ttl: int
    now: float
    model: str
    lane: str
    owner: str  # '' for none
    retain_s: int
    keep_s: int  # 0: no marks
    hook: str  # '1': the owner has a webhook endpoint
    tenant: str
    share_max: int
    fair: str  # '1': fair share on
    weight: float
    requests: Parts  # AdmittedRequest each


@dataclass(frozen=True)
class Room(ScriptCall):
    """room.lua: whether `n` more entries of `tenant` fit now ('', 'bound' or 'share')."""

    script = "room"
    stream: Key
    other: Key
    n: int
    max_queued: int
    lane_max: int
    tenant: str
    share_max: int


@dataclass(frozen=True)
class Cancel(ScriptCall):
    """cancel.lua: flag a request cancelled; one still queued ends cancelled at once."""

    script = "cancel"
    status: Key
    flag: Key  # the cancel flag the worker watches
    reply: Key
    interactive: Key  # the request's shard's streams
    bulk: Key
    now: float
    cancel_ttl: int
    result_ttl: int
    reply_ttl: int
    done_channel: str
    rid: str
    group: str


@dataclass(frozen=True)
class Quota(ScriptCall):
    """quota.lua: charge a tenant's requests and tokens per minute for one call, or refuse it."""

    script = "quota"
    requests_bucket: Key
    tokens_bucket: Key
    records: KeyList  # one charge record per request
    request_limit: int  # 0: none
    token_limit: int  # 0: none
    record_ttl: int
    tokens: Spread  # each request's tokens


@dataclass(frozen=True)
class QuotaPeek(ScriptCall):
    """quota_peek.lua: a requests bucket and Redis' clock, charging nothing."""

    script = "quota_peek"
    bucket: Key


@dataclass(frozen=True)
class QuotaRelease(ScriptCall):
    """quota_release.lua: give back what quota.lua charged for a call then refused."""

    script = "quota_release"
    requests_bucket: Key
    records: KeyList  # one charge record per request
    request_limit: int  # 0: none


@dataclass(frozen=True)
class TenantStream(ScriptCall):
    """tenant_stream.lua: take a lease on one more open stream of a tenant (`limit` > 0), or
    refresh the leases of `streams` (`limit` 0)."""

    script = "tenant_stream"
    key: Key  # the tenant's streams set
    lease_ms: int
    limit: int
    streams: Spread  # the one to take; those to refresh
