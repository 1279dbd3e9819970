"""The api's Prometheus metrics: admissions, rejections, and each model's queues (read at scrape)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

ADMITTED = Counter("sluice_requests_admitted", "Requests put on a model's stream", ["model", "lane"])
REJECTED = Counter("sluice_requests_rejected", "Requests refused at admission, by reason", ["model", "reason"])
QUEUE_DEPTH = Gauge("sluice_queue_depth", "Entries on a model's stream (waiting plus running)", ["model", "lane"])
OLDEST_AGE = Gauge("sluice_queue_oldest_age_seconds", "Age of the oldest entry on a model's stream",
                   ["model", "lane"])
