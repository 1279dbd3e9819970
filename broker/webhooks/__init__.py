"""Webhooks in Redis: the outboxes the final-writing scripts append to, endpoints, deliveries and
each endpoint's circuit breaker (docs/webhooks.md)."""

from sluice.broker.webhooks import outbox
from sluice.broker.webhooks.outbox import SubscribedOwners

__all__ = ["SubscribedOwners", "outbox"]
