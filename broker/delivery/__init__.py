"""Delivery, the worker's side of a lane: the consumer (fetch, guard, lease, commit), the entries
it holds, fair share, prefix affinity, quarantine, dead letters, consumer names, the lanes and
shards read, the inference log, and the expiry of overdue entries."""

from sluice.broker.delivery.affinity import group_of
from sluice.broker.delivery.deliveries import Delivery, Sent, StartDecision
from sluice.broker.delivery.fair_share import expected_cost, staged_streams

__all__ = ["Delivery", "Sent", "StartDecision", "expected_cost", "group_of", "staged_streams"]
