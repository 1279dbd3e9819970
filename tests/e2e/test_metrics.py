"""Prometheus metrics of the api and of a worker (its own port), after real traffic."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sluice.supervisor.processes import free_port
from tests.e2e.conftest import null_stack, wait_done

MODELS = "models:\n  - name: met\n    continuous_batching_config: {max_concurrent_batch_size: 8}\n"


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture(scope="module")
def metered(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    port = free_port()
    with null_stack(tmp_path_factory.mktemp("met"), MODELS, "met", SLUICE_MAX_QUEUED="6",
                    SLUICE_WORKER_METRICS_PORT=str(port)) as stack:
        yield stack.url, port


async def test_api_and_worker_metrics(metered: tuple[str, int]) -> None:
    url, worker_port = metered
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        rids = []
        for _ in range(5):
            r = await client.post("/v1/requests", json={"prompt": "count", "max_tokens": 3})
            rids.append(r.json()["id"])
        for rid in rids:
            assert (await wait_done(client, rid))["status"] == "done"
        rows = [{"prompt": "a"}, {"prompt": "b"}]
        assert (await client.post("/v1/models/met/infer", json=rows)).status_code == 400
        api = samples((await client.get("/metrics")).text)
    assert api[("sluice_requests_admitted_total", frozenset({("model", "met"), ("lane", "interactive")}))] == 5
    assert api[("sluice_requests_rejected_total", frozenset({("model", "met"), ("reason", "batch_size")}))] == 1
    assert api[("sluice_queue_depth", frozenset({("model", "met"), ("lane", "interactive")}))] == 0
    assert ("sluice_queue_oldest_age_seconds", frozenset({("model", "met"), ("lane", "bulk")})) in api

    async with httpx.AsyncClient(timeout=10) as client:
        worker = samples((await client.get(f"http://127.0.0.1:{worker_port}/metrics")).text)
    met = frozenset({("model", "met")})
    assert worker[("sluice_requests_completed_total", frozenset({("model", "met"), ("status", "done")}))] == 5
    assert worker[("sluice_generation_tokens_total", met)] == 15
    for name in ("sluice_e2e_request_latency_seconds_count", "sluice_time_to_first_token_seconds_count",
                 "sluice_request_queue_time_seconds_count", "sluice_time_per_output_token_seconds_count"):
        assert worker[(name, met)] == 5, name
    assert worker[("sluice_batch_size_count", frozenset({("model", "met"), ("mode", "continuous")}))] == 5
    assert any(name == "sluice_num_requests_running" for name, _ in worker)
