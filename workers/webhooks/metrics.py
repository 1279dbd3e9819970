"""The webhook sender's Prometheus metrics, served on its --metrics-port."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

DELIVERIES = Counter("sluice_webhook_deliveries", "Webhook delivery attempts by endpoint and outcome "
                     "(delivered, retried, dead, dropped: its endpoint was deleted)", ["endpoint", "outcome"])
BACKLOG = Gauge("sluice_webhook_backlog", "Webhook deliveries not done: in flight and waiting to be retried")
OLDEST = Gauge("sluice_webhook_oldest_pending_seconds", "Age of the oldest webhook delivery not done")
