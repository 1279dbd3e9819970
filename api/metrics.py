"""The api's Prometheus metrics: admissions, rejections, and each model's queues (read at scrape).

With several api processes on one port (`sluice api --workers N`), PROMETHEUS_MULTIPROC_DIR is
set before any of them starts: each process writes its samples there, and whichever process
answers a scrape reports them all (counters summed; the queue gauges, read from Redis by the
scraping process, as it last set them).
"""

from __future__ import annotations

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
    multiprocess,
)

ADMITTED = Counter("sluice_requests_admitted", "Requests put on a model's stream", ["model", "lane"])
REJECTED = Counter("sluice_requests_rejected", "Requests refused at admission, by reason",
                   ["model", "reason"])
# Per tenant: the label values are the configured tenants' names (config/tenants.py) and `default`.
TENANT_ADMITTED = Counter("sluice_tenant_requests_admitted", "Requests a tenant put on a model's stream",
                          ["tenant", "model"])
TENANT_QUEUED = Gauge("sluice_tenant_queued",
                      "Entries a tenant holds queued on a model (staged or on a lane stream, both "
                      "lanes; fair share's count)", ["tenant", "model"], multiprocess_mode="mostrecent")
TENANT_REFUSED = Counter("sluice_tenant_requests_refused",
                         "Requests of a tenant refused at admission, by reason (a limit's name, or "
                         "queue_full)",
                         ["tenant", "reason"])
QUEUE_DEPTH = Gauge("sluice_queue_depth",
                    "Requests waiting for a worker on a model's lane (running ones apart)",
                    ["model", "lane"], multiprocess_mode="mostrecent")
QUEUE_RUNNING = Gauge("sluice_queue_running",
                      "Requests a worker has taken from a model's lane and not finished",
                      ["model", "lane"], multiprocess_mode="mostrecent")
OLDEST_AGE = Gauge("sluice_queue_oldest_age_seconds",
                   "How long the oldest request waiting on a model's lane has waited (0: none waits)",
                   ["model", "lane"], multiprocess_mode="mostrecent")


def exposition() -> tuple[bytes, str]:
    """The text a scrape gets: this process's registry, or every api process's samples."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(), CONTENT_TYPE_LATEST
