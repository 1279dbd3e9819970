"""The typed calls of the webhooks wing's scripts (broker/plumbing/scripts.py: one frozen dataclass
per script, its KEYS then its ARGV in order, named as the script binds them). Every key is in the
`{webhooks}` slot."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.broker.plumbing import CallPart, Key, Parts, ScriptCall


@dataclass(frozen=True)
class NewDelivery(CallPart):
    """One delivery of an event to one endpoint (webhook_enqueue.lua's)."""

    delivery: Key  # its hash
    endpoint: str
    event_id: str
    body: str


@dataclass(frozen=True)
class WebhookEnqueue(ScriptCall):
    """webhook_enqueue.lua: an outbox event's deliveries, created at once and leased to the caller."""

    script = "webhook_enqueue"
    due: Key
    lease_until: float
    now: float
    deliveries: Parts  # NewDelivery each


@dataclass(frozen=True)
class WebhookClaim(ScriptCall):
    """webhook_claim.lua: lease up to `count` deliveries that are due."""

    script = "webhook_claim"
    due: Key
    now: float
    lease_until: float
    count: int


@dataclass(frozen=True)
class WebhookSettle(ScriptCall):
    """webhook_settle.lua: the outcome of one attempt (ok, retry, later or dead)."""

    script = "webhook_settle"
    due: Key
    delivery: Key
    dead: Key
    counts: Key  # the minute's outcome counts
    outcome: str
    next_at: float
    err: str
    now: float
    dead_max: int
    counted: str  # '' for none
    counts_ttl: int


@dataclass(frozen=True)
class WebhookBreaker(ScriptCall):
    """webhook_breaker.lua: an endpoint's circuit breaker: `check`, `fail` or `ok`."""

    script = "webhook_breaker"
    key: Key  # the endpoint's breaker hash
    op: str
    now: float
    threshold: int
    arg4: float | str  # probe_s (check) or was_probe ('1' or '', fail)
    base_s: float
    max_s: float
    ttl: int
