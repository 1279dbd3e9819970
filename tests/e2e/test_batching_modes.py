"""Dynamic and single batching, multi-row JSON/Arrow inference, the inference log, custom runtimes
and reconfiguration, on the real engine."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import httpx
import pyarrow as pa
import pytest

from sluice.config.batching import (
    CONTINUOUS_MULTI_ROW,
    CONTINUOUS_WITH_SINGLE,
    DYNAMIC_WITH_SINGLE,
    MAX_BATCH_SIZE_EXCEEDED,
)
from tests.e2e.conftest import CUSTOM, DYNAMIC, MODEL, configure, submit, wait_done

pytestmark = [pytest.mark.engine, pytest.mark.xdist_group("engine"), pytest.mark.usefixtures("restore_continuous")]

ARROW = "application/vnd.apache.arrow.stream"
CAPITALS = [("The capital of France is", " Paris"), ("The capital of Germany is", " Berlin"),
            ("The capital of Italy is", " Rome")]


async def log_records(client: httpx.AsyncClient, model: str, request_ids: list[str],
                      timeout_s: float = 15.0) -> list[dict]:
    """The log records of these requests. The worker writes a batch's records after its
    results are committed (a client can hold its result first): wait for all of them."""
    wanted = set(request_ids)
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        records = (await client.get(f"/v1/models/{model}/logs", params={"limit": 1000})).json()
        found = [r for r in records if r["request_id"] in wanted]
        if {r["request_id"] for r in found} >= wanted or asyncio.get_running_loop().time() > deadline:
            return found
        await asyncio.sleep(0.1)


def arrow_body(rows: list[dict], schema: pa.Schema) -> bytes:
    table = pa.Table.from_pylist(rows, schema=schema)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


INPUT = pa.schema([pa.field("prompt", pa.string()), pa.field("max_tokens", pa.int64())])


async def test_twelve_requests_make_three_fifo_batches_of_four(client: httpx.AsyncClient) -> None:
    await configure(client, DYNAMIC, {"dynamic_batching_config": {
        "max_batch_delay_ms": 5000, "batch_size_target": 4, "batch_size_limit": 4}})
    rids = [await submit(client, DYNAMIC, prompt=f"Say the number {i}:", max_tokens=4, temperature=0.0)
            for i in range(12)]
    results = await asyncio.gather(*(wait_done(client, r) for r in rids))
    assert all(r["status"] == "done" for r in results), results
    records = await log_records(client, DYNAMIC, rids)
    assert [r["request_id"] for r in records] == rids  # the log is in processed (FIFO) order
    batches: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        batches[r["batch_id"]].append(r)
    assert [[x["request_id"] for x in b] for b in batches.values()] == [rids[0:4], rids[4:8], rids[8:12]]
    for b in batches.values():
        assert [x["position"] for x in b] == [0, 1, 2, 3]
        assert all(x["output"]["num_output_tokens"] == 4 for x in b)


async def test_lone_request_waits_for_the_batch_delay(client: httpx.AsyncClient) -> None:
    await configure(client, DYNAMIC, {"dynamic_batching_config": {
        "max_batch_delay_ms": 200, "batch_size_target": 4}})
    rid = await submit(client, DYNAMIC, prompt="Hello", max_tokens=2, temperature=0.0)
    assert (await wait_done(client, rid))["status"] == "done"
    (record,) = await log_records(client, DYNAMIC, [rid])
    assert record["batch_size"] == 1
    waited = record["released"] - record["timings"]["enqueued"]
    assert waited >= 0.2, f"released {waited:.3f}s after it was enqueued"


async def test_three_rows_json_and_arrow_to_a_dynamic_model(client: httpx.AsyncClient) -> None:
    await configure(client, DYNAMIC, {"dynamic_batching_config": {
        "max_batch_delay_ms": 50, "batch_size_target": 4, "batch_size_limit": 8}})
    rows = [{"prompt": p, "max_tokens": 4} for p, _ in CAPITALS]
    r = await client.post(f"/v1/models/{DYNAMIC}/infer", json=rows, params={"temperature": 0})
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out) == 3 and set(out[0]) == {"generated_text", "num_output_tokens"}
    for (_, answer), row in zip(CAPITALS, out):
        assert row["generated_text"].startswith(answer), out

    r = await client.post(f"/v1/models/{DYNAMIC}/infer", content=arrow_body(rows, INPUT),
                          headers={"content-type": ARROW}, params={"temperature": 0})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith(ARROW)
    table = pa.ipc.open_stream(r.content).read_all()
    assert table.schema.names == ["generated_text", "num_output_tokens"]
    assert table.column("generated_text").to_pylist() == [row["generated_text"] for row in out]

    many = [{"prompt": "hi", "max_tokens": 1}] * 9
    r = await client.post(f"/v1/models/{DYNAMIC}/infer", json=many)
    assert r.status_code == 400 and r.json()["error"]["message"] == MAX_BATCH_SIZE_EXCEEDED


async def test_multi_row_to_a_continuous_model_is_refused(client: httpx.AsyncClient) -> None:
    rows = [{"prompt": p, "max_tokens": 4} for p, _ in CAPITALS]
    r = await client.post(f"/v1/models/{MODEL}/infer", json=rows)
    assert r.status_code == 400 and r.json()["error"]["message"] == CONTINUOUS_MULTI_ROW
    r = await client.post(f"/v1/models/{MODEL}/infer", content=arrow_body(rows, INPUT),
                          headers={"content-type": ARROW})
    assert r.status_code == 400 and r.json()["error"]["message"] == CONTINUOUS_MULTI_ROW
    r = await client.post(f"/v1/models/{MODEL}/infer", json=rows[:1], params={"temperature": 0})
    assert r.status_code == 200 and r.json()[0]["generated_text"].startswith(" Paris")


async def test_bad_rows_get_4xx_naming_the_problem(client: httpx.AsyncClient, dynamic: None) -> None:
    url = f"/v1/models/{DYNAMIC}/infer"
    r = await client.post(url, json=[{"prompt": "hi", "colour": "red"}])
    assert r.status_code == 400 and "colour" in r.json()["error"]["message"]
    r = await client.post(url, json=[{"max_tokens": 3}])
    assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]
    r = await client.post(url, json=[{"prompt": "hi", "max_tokens": "many"}])
    assert r.status_code == 400
    r = await client.post(url, content=b"not arrow at all", headers={"content-type": ARROW})
    assert r.status_code == 400 and "Arrow" in r.json()["error"]["message"]
    r = await client.post(url, content=b"prompt=hi", headers={"content-type": "text/plain"})
    assert r.status_code == 415
    r = await client.post(url, json=[])
    assert r.status_code == 400


async def test_configuration_errors_use_the_documented_messages(client: httpx.AsyncClient) -> None:
    r = await client.put(f"/v1/models/{DYNAMIC}/config", json={
        "batch_config": "single", "dynamic_batching_config": {"batch_size_target": 2}})
    assert r.status_code == 400 and DYNAMIC_WITH_SINGLE in r.json()["error"]["message"]
    r = await client.put(f"/v1/models/{DYNAMIC}/config", json={
        "batch_config": "single", "continuous_batching_config": {"max_concurrent_batch_size": 2}})
    assert r.status_code == 400 and CONTINUOUS_WITH_SINGLE in r.json()["error"]["message"]
    r = await client.put(f"/v1/models/{DYNAMIC}/config", json={"dynamic_batching_config": {"batch_size_target": 0}})
    assert r.status_code == 422 and "batch_size_target" in r.json()["error"]["message"]
    r = await client.put(f"/v1/models/{DYNAMIC}/config", json={})
    assert r.status_code == 400


async def test_single_mode_runs_one_request_per_batch(client: httpx.AsyncClient) -> None:
    await configure(client, DYNAMIC, {"batch_config": "single"})
    rids = [await submit(client, DYNAMIC, prompt=f"Word {i}:", max_tokens=3) for i in range(3)]
    results = [await wait_done(client, r) for r in rids]
    assert [r["status"] for r in results] == ["done"] * 3
    records = await log_records(client, DYNAMIC, rids)
    assert [r["request_id"] for r in records] == rids
    assert all(r["batch_size"] == 1 and r["position"] == 0 for r in records)
    assert len({r["batch_id"] for r in records}) == 3
    r = await client.post(f"/v1/models/{DYNAMIC}/infer", json=[{"prompt": "a"}, {"prompt": "b"}])
    assert r.status_code == 400


async def test_switching_continuous_to_dynamic_loses_nothing(client: httpx.AsyncClient) -> None:
    before = await configure(client, DYNAMIC, {"continuous_batching_config": {"max_concurrent_batch_size": 8}})
    rids = [await submit(client, DYNAMIC, prompt=f"Tell me about number {i}.", max_tokens=24) for i in range(16)]
    r = await client.put(f"/v1/models/{DYNAMIC}/config", json={"dynamic_batching_config": {
        "max_batch_delay_ms": 20, "batch_size_target": 4}})
    assert r.status_code == 200 and r.json()["version"] == before + 1
    rids += [await submit(client, DYNAMIC, prompt=f"And number {i}.", max_tokens=8) for i in range(8)]
    results = await asyncio.gather(*(wait_done(client, rid) for rid in rids))
    assert [res["status"] for res in results] == ["done"] * len(rids)
    models = (await client.get("/v1/models")).json()["data"]
    (dyn,) = [m for m in models if m["id"] == DYNAMIC]
    assert dyn["version"] == before + 1 and dyn["mode"] == "dynamic"


async def test_logs_as_arrow(client: httpx.AsyncClient) -> None:
    r = await client.get(f"/v1/models/{DYNAMIC}/logs", params={"limit": 5}, headers={"accept": ARROW})
    assert r.status_code == 200
    table = pa.ipc.open_stream(r.content).read_all()
    assert table.num_rows == 5
    assert {"batch_id", "position", "request_id", "input", "output", "timings"} <= set(table.column_names)


async def test_custom_runtime_adds_inputs_and_outputs_and_still_batches(client: httpx.AsyncClient) -> None:
    rows = [{"prompt": "Name a fruit.", "max_tokens": 12, "system_prompt": "You are terse."},
            {"prompt": "Name a colour.", "max_tokens": 12}]
    r = await client.post(f"/v1/models/{CUSTOM}/infer", json=rows, params={"temperature": 0})
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out) == 2
    for row in out:
        assert set(row) == {"generated_text", "num_output_tokens", "num_words"}
        assert row["num_words"] == len(row["generated_text"].split())
    rid = r.headers["x-request-id"]
    records = await log_records(client, CUSTOM, [rid])
    assert [x["input"].get("system_prompt") for x in records] == ["You are terse.", None]
    assert [x["position"] for x in records] == [0, 1] and records[0]["batch_id"] == records[1]["batch_id"]


async def test_models_configure_command(client: httpx.AsyncClient, stack) -> None:
    import subprocess
    import sys

    before = (await client.get(f"/v1/models/{DYNAMIC}")).json()["version"]
    cli = [sys.executable, "-m", "sluice.cli", "models", "configure", DYNAMIC, "--url", stack.url]
    done = subprocess.run([*cli, "--dynamic", "--batch-size-target", "2", "--max-batch-delay-ms", "30"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"v{before + 1}: dynamic" in done.stdout
    model = (await client.get(f"/v1/models/{DYNAMIC}")).json()
    assert model["config"]["dynamic_batching_config"] == {
        "max_batch_delay_ms": 30, "batch_size_target": 2, "batch_size_limit": None}
    bad = subprocess.run([*cli, "--single", "--continuous", "3"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0
