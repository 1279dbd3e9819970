"""Bulk jobs through the openai SDK (files + batches), run by Celery on null-engine workers."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis as redis_sync

from sluice.broker.keys import ModelKeys, backlog, staged
from tests.e2e.conftest import NullStack, null_stack, settled_log

MODEL = "bat"
MODELS = f"models:\n  - name: {MODEL}\n    continuous_batching_config: {{max_concurrent_batch_size: 16}}\n"


def batch_file(n: int, *, max_tokens: int = 3, broken_at: int | None = None) -> bytes:
    lines = [json.dumps({"custom_id": f"row-{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": MODEL, "prompt": f"line {i}", "max_tokens": max_tokens}})
             for i in range(n)]
    if broken_at is not None:
        lines.insert(broken_at, '{"custom_id": "broken", "method": "POST"')
    return "\n".join(lines).encode()


def wait_batch(client: openai.OpenAI, batch_id: str, until: set[str], timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in until:
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)


def start_batch(client: openai.OpenAI, n: int, *, max_tokens: int, running: int):
    """Upload n lines, create the batch, and return once `running` rows have completed."""
    f = client.files.create(file=("in.jsonl", io.BytesIO(batch_file(n, max_tokens=max_tokens))), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while client.batches.retrieve(batch.id).request_counts.completed < running:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    return batch


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NullStack]:
    with null_stack(tmp_path_factory.mktemp("bat"), MODELS, MODEL, jobs=True, SLUICE_NULL_TOKEN_DELAY_S="0.01",
                    SLUICE_BULK_OUTSTANDING="8", SLUICE_JOB_LOCK_TTL_S="3") as s:
        yield s


@pytest.fixture
def sdk(stack: NullStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)


def test_a_200_line_batch_through_the_sdk(sdk: openai.OpenAI) -> None:
    f = sdk.files.create(file=("in.jsonl", io.BytesIO(batch_file(200, broken_at=7))), purpose="batch")
    assert sdk.files.retrieve(f.id).bytes == len(batch_file(200, broken_at=7))
    batch = sdk.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    assert batch.status == "validating"
    batch = wait_batch(sdk, batch.id, {"completed", "failed"})
    assert batch.status == "completed", batch
    assert batch.request_counts.total == 201 and batch.request_counts.completed == 200
    assert batch.request_counts.failed == 1
    out = [json.loads(x) for x in sdk.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in out) == sorted(f"row-{i}" for i in range(200))
    for r in out:
        assert r["response"]["status_code"] == 200 and r["error"] is None
        assert r["response"]["body"]["choices"][0]["text"] == " t0 t1 t2", r
    errors = [json.loads(x) for x in sdk.files.content(batch.error_file_id).text.splitlines()]
    assert len(errors) == 1 and "line 8" in errors[0]["error"]["message"]
    assert batch.id in [b.id for b in sdk.batches.list()]


def test_bad_batches_are_refused(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        sdk.batches.create(input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h")
    f = sdk.files.create(file=("in.jsonl", io.BytesIO(batch_file(2))), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        sdk.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        sdk.files.create(file=("x.jsonl", io.BytesIO(b"{}")), purpose="fine-tune")


def test_cancel_a_running_batch(sdk: openai.OpenAI) -> None:
    batch = start_batch(sdk, 200, max_tokens=40, running=10)
    assert sdk.batches.cancel(batch.id).status == "cancelling"
    batch = wait_batch(sdk, batch.id, {"cancelled", "completed"})
    assert batch.status == "cancelled"
    assert 10 <= batch.request_counts.completed < 200
    out = sdk.files.content(batch.output_file_id).text.splitlines()
    assert len(out) == batch.request_counts.completed  # partial output: what finished


def test_the_job_survives_a_killed_celery_worker(stack: NullStack, sdk: openai.OpenAI) -> None:
    batch = start_batch(sdk, 120, max_tokens=20, running=10)
    stack.procs["jobs"].send_signal(signal.SIGKILL)  # mid-job
    stack.procs["jobs"].wait(10)
    stack.procs["jobs"] = subprocess.Popen([sys.executable, "-m", "sluice.cli", "jobs"], env=stack.env)
    batch = wait_batch(sdk, batch.id, {"completed", "failed"}, timeout_s=120)
    assert batch.status == "completed" and batch.request_counts.completed == 120
    r = redis_sync.Redis.from_url(stack.redis.url, decode_responses=True)
    rids = r.hgetall(f"{{sluice:batch:{batch.id}}}:rids")
    assert len(rids) == 120 and len(set(rids.values())) == 120
    ran = [x["request_id"] for x in settled_log(r, ModelKeys(MODEL).log, set(rids.values()))]
    assert len(ran) == 120 and len(set(ran)) == 120  # every row ran, none twice


def test_interactive_requests_overtake_bulk_rows_queued_before_them(stack: NullStack, sdk: openai.OpenAI) -> None:
    """DESIGN: workers read the interactive lane first, so a bulk job never delays interactive
    traffic. With the worker paused, a job queues its rows and then interactive requests arrive:
    18 entries for 16 slots, so two must wait when it resumes, and they must be bulk rows,
    though those were queued first. (Comparing finishing times proves nothing: a large job
    ends after a few requests whatever the order the worker reads the lanes in.)"""
    keys = ModelKeys(MODEL)
    r = redis_sync.Redis.from_url(stack.redis.url, decode_responses=True)
    wait_until(lambda: not queued_ids(r, keys.requests) + queued_ids(r, keys.bulk), "earlier tests' entries drained")
    worker = stack.procs["worker"]
    pause_in_blocking_read(worker, r)
    try:
        f = sdk.files.create(file=("in.jsonl", io.BytesIO(batch_file(8, max_tokens=300))), purpose="batch")
        batch = sdk.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        rids_key = f"{{sluice:batch:{batch.id}}}:rids"
        # SLUICE_BULK_OUTSTANDING=8: the whole job is on the bulk lane before anything interactive
        # (the first row on its stream, the others staged for their tenant's turn while it waits)
        wait_until(lambda: len(r.hgetall(rids_key)) == 8
                   and set(r.hgetall(rids_key).values()) <= set(queued_ids(r, keys.bulk)),
                   "the job's 8 rows on the bulk lane")
        bulk = list(r.hgetall(rids_key).values())
        interactive = []
        with httpx.Client(base_url=stack.url, timeout=30) as client:
            for i in range(10):
                answer = client.post("/v1/requests", json={"model": MODEL, "prompt": f"now {i}", "max_tokens": 300})
                assert answer.status_code == 202, answer.text
                interactive.append(answer.json()["id"])
    finally:
        worker.send_signal(signal.SIGCONT)

    def status(rids: list[str], field: str) -> list[str]:
        with r.pipeline(transaction=False) as pipe:
            for rid in rids:
                pipe.hget(keys.status(rid), field)
            return pipe.execute()

    done = wait_batch(sdk, batch.id, {"completed", "failed"})
    assert done.status == "completed" and done.request_counts.completed == 8
    wait_until(lambda: None not in status(interactive, "finished_at"), "every interactive request final")
    assert status(interactive, "state") == ["done"] * 10
    # Read from the worker's own start times once all is over, not by looking while it runs: a
    # test process starved past the first wave (3 s) would find the waiting rows started by then.
    last_interactive = max(float(t) for t in status(interactive, "started_at"))
    waiting = [rid for rid, t in zip(bulk, status(bulk, "started_at")) if float(t) > last_interactive]
    assert len(waiting) >= 18 - 16, f"bulk rows started after the interactive requests took their slots: {waiting}"


def queued_ids(r: redis_sync.Redis, stream: str) -> list[str]:
    """The ids of the requests queued on a lane: on its stream, and staged for their tenants'
    turns (fair share: docs/delivery.md)."""
    tenants = r.zrange(backlog(stream), 0, -1)
    return [e["id"] for s in [stream, *(staged(stream, t) for t in tenants)] for _, e in r.xrange(s)]


def pause_in_blocking_read(worker: subprocess.Popen, r: redis_sync.Redis) -> None:
    """SIGSTOP the worker while it waits in its blocking read of the interactive lane, the one
    place where an idle worker has no decision pending. Stopped anywhere else it may have read
    the interactive lane (empty) and not yet the bulk one: resumed, it would read the bulk lane
    first, the job's rows being there by then (so it did in a CI run on a loaded machine). The
    worker is stopped again, after it ran a little, until Redis shows it blocked in XREADGROUP,
    or, placing by prefix (the model's default), in the XREAD of the lane's doorbell
    (docs/prefix-affinity.md): woken, it dispatches the interactive lane first either way."""
    deadline = time.monotonic() + 60
    while True:
        worker.send_signal(signal.SIGSTOP)
        wait_until(lambda: stopped(worker.pid), "the worker stopped")
        if any(c["name"] == "sluice-worker" and c["cmd"] in ("xreadgroup", "xread") and "b" in c["flags"]
               for c in r.client_list()):
            return
        worker.send_signal(signal.SIGCONT)
        assert time.monotonic() < deadline, "the worker was never found waiting in its blocking read"
        time.sleep(0.05)


def stopped(pid: int) -> bool:
    """Every thread of the process is in the stopped state (a SIGSTOP is delivered asynchronously)."""
    tasks = Path(f"/proc/{pid}/task").iterdir()
    return all((t / "stat").read_text().rsplit(")", 1)[1].split()[0] == "T" for t in tasks)


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.02)


@pytest.mark.parametrize("suffix", [".parquet", ".arrow", ".jsonl"])
def test_batch_run_command(stack: NullStack, tmp_path: Path, suffix: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = tmp_path / f"in{suffix}"
    table = pa.table({"prompt": [f"p{i}" for i in range(30)], "max_tokens": [2 + i % 3 for i in range(30)]})
    if suffix == ".parquet":
        pq.write_table(table, source)
    elif suffix == ".arrow":
        with pa.OSFile(str(source), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
    else:
        source.write_bytes(batch_file(30))
    out = tmp_path / f"out{suffix}"
    done = subprocess.run([sys.executable, "-m", "sluice.cli", "batch", "run", str(source), "-o", str(out),
                           "--model", MODEL, "--url", stack.url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "completed: 30 done, 0 failed of 30" in done.stdout
    if suffix == ".jsonl":
        records = [json.loads(x) for x in out.read_text().splitlines()]
        assert sorted(r["custom_id"] for r in records) == sorted(f"row-{i}" for i in range(30))
        return
    result = pq.read_table(out) if suffix == ".parquet" else pa.ipc.open_file(out).read_all()
    assert result.column("custom_id").to_pylist() == [str(i) for i in range(30)]  # input order
    assert result.column("num_output_tokens").to_pylist() == table.column("max_tokens").to_pylist()
    assert result.column("generated_text").to_pylist()[0] == " t0 t1"
