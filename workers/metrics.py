"""The worker's Prometheus metrics (vLLM's names, prefixed sluice_), served on a port per worker."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from sluice.protocol.messages import FinalResult
from sluice.workers.engines.prefix_cache import PrefixCacheCounters

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
_TOKEN_TIME = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5)

COMPLETED = Counter("sluice_requests_completed", "Requests finished, by final status", ["model", "status"])
RUNNING = Gauge("sluice_num_requests_running", "Requests in the engine now", ["model", "worker"])
ADMITTED_CONCURRENCY = Gauge("sluice_admitted_concurrency",
                             "Requests the worker admits to the engine at once (below capacity where the "
                             "model's TPOT target holds it)", ["model", "worker"])
BATCH_SIZE = Histogram("sluice_batch_size", "Requests per batch handed to the engine", ["model", "mode"],
                       buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
QUEUE_TIME = Histogram("sluice_request_queue_time_seconds", "Enqueued to started", ["model"],
                       buckets=_LATENCY)
TTFT = Histogram("sluice_time_to_first_token_seconds", "Enqueued to first token", ["model"], buckets=_LATENCY)
TPOT = Histogram("sluice_time_per_output_token_seconds", "Mean time per output token after the first",
                 ["model"], buckets=_TOKEN_TIME)
E2E = Histogram("sluice_e2e_request_latency_seconds", "Enqueued to final result", ["model"], buckets=_LATENCY)
GENERATION_TOKENS = Counter("sluice_generation_tokens", "Output tokens generated", ["model"])
PROMPT_TOKENS = Counter("sluice_prompt_tokens", "Prompt tokens processed", ["model"])
REPLY_CALLS = Counter("sluice_reply_script_calls", "reply.lua calls (each writes every request's new tokens "
                      "of one slot)", ["model"])
# The tenant is the one the api wrote on the request (a configured tenant's name, or `default`).
TENANT_SERVED_TOKENS = Counter("sluice_tenant_served_tokens", "Prompt plus output tokens served to a tenant",
                               ["tenant", "model"])
RECLAIMS = Counter("sluice_reclaims", "Entries taken over from workers whose lease expired", ["model"])
DEAD_LETTERS = Counter("sluice_dead_letters", "Requests moved to the dead-letter stream", ["model"])
# vLLM's vllm:prefix_cache_queries and vllm:prefix_cache_hits, per worker (each has its own cache):
# the hit rate is hits / queries over a window.
PREFIX_CACHE_QUERIES = Counter("sluice_prefix_cache_queries",
                               "Prompt tokens looked up in the engine's prefix cache", ["model", "worker"])
PREFIX_CACHE_HITS = Counter("sluice_prefix_cache_hits", "Prompt tokens found in the engine's prefix cache",
                            ["model", "worker"])


def serve(port: int, host: str = "0.0.0.0") -> None:
    start_http_server(port, addr=host)


def observe_final(model: str, final: FinalResult, tenant: str = "default") -> None:
    COMPLETED.labels(model, final.status.value).inc()
    t = final.timings
    if final.usage:
        GENERATION_TOKENS.labels(model).inc(final.usage.completion_tokens)
        PROMPT_TOKENS.labels(model).inc(final.usage.prompt_tokens)
        served = final.usage.prompt_tokens + final.usage.completion_tokens
        TENANT_SERVED_TOKENS.labels(tenant, model).inc(served)
    if t.enqueued is None:
        return
    if t.started is not None:
        QUEUE_TIME.labels(model).observe(max(t.started - t.enqueued, 0.0))
    if t.first_token is not None:
        TTFT.labels(model).observe(max(t.first_token - t.enqueued, 0.0))
    if t.finished is not None:
        E2E.labels(model).observe(max(t.finished - t.enqueued, 0.0))
        tokens = final.usage.completion_tokens if final.usage else 0
        if t.first_token is not None and tokens > 1:
            TPOT.labels(model).observe((t.finished - t.first_token) / (tokens - 1))


class PrefixCacheExport:
    """One worker's engine prefix-cache counters (cumulative in the engine) into the metrics, by
    what each sync adds, and into its heartbeat (the dashboard's hit rate per worker)."""

    def __init__(self) -> None:
        self._counted = (0, 0)

    def sync(self, model: str, worker: str, counters: PrefixCacheCounters | None) -> None:
        if counters is None:
            return
        PREFIX_CACHE_QUERIES.labels(model, worker).inc(counters.queries - self._counted[0])
        PREFIX_CACHE_HITS.labels(model, worker).inc(counters.hits - self._counted[1])
        self._counted = (counters.queries, counters.hits)

    @staticmethod
    def heartbeat(counters: PrefixCacheCounters | None) -> dict[str, int | None]:
        if counters is None:
            return {}
        return {"prefix_cache_queries": counters.queries, "prefix_cache_hits": counters.hits,
                "prefix_cache_blocks": counters.blocks, "prefix_cache_block_size": counters.block_size}
