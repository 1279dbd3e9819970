"""The big batch input file of `sluice bench hostile` (issue 29, finding 4): a file of a million
131-byte lines (about 131 MB) uploaded, then handed to batches.create. With the default line cap
(SLUICE_MAX_BATCH_LINES) create answers a 400 naming it; with the cap raised the jobs worker
checks every line (a chunk at a time, off its event loop) and runs them, and the bench cancels
the batch once rows have run for `run_s`. Either way the jobs worker's RSS is sampled meanwhile
(target: under 500 MB)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from sluice.bench.hostile_probe import Target

LINE_BYTES = 131  # with its newline, as the file of the issue (1,000,000 lines, 131 MB)
FINAL = ("completed", "failed", "cancelled", "expired")


def write_file(path: Path, lines: int) -> int:
    """A batch input file of `lines` valid /v1/completions lines for the model `echo`; its size."""
    head = ('{"custom_id":"line-%07d","method":"POST","url":"/v1/completions",'
            '"body":{"model":"echo","prompt":"')
    tail = '","max_tokens":4}}\n'
    pad = "p" * (LINE_BYTES - len(head % 0) - len(tail))
    template = head + pad + tail
    with path.open("w") as out:
        for start in range(0, lines, 10_000):
            out.write("".join(template % i for i in range(start, min(start + 10_000, lines))))
    return path.stat().st_size


async def _until(check: Callable[[], Awaitable[bool]], within_s: float, every_s: float = 0.5) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if await check():
            return True
        await asyncio.sleep(every_s)
    return False


def big_batch(lines: int, folder: Path,
              run_s: float = 30.0) -> Callable[[Target], Awaitable[tuple[str, float]]]:
    async def attack(t: Target) -> tuple[str, float]:
        path = folder / f"batch-{lines}.jsonl"
        size = await asyncio.to_thread(write_file, path, lines)
        async with t.client(timeout=900) as client:
            t0 = time.perf_counter()
            with path.open("rb") as f:
                r = await client.post("/v1/files", files={"file": (path.name, f)}, data={"purpose": "batch"})
            uploaded = f"upload {r.status_code} ({size / 1e6:.0f} MB, {time.perf_counter() - t0:.1f} s)"
            if r.status_code != 200:
                return uploaded, time.perf_counter() - t0
            t0 = time.perf_counter()
            r = await client.post("/v1/batches",
                                  json={"input_file_id": r.json()["id"], "endpoint": "/v1/completions"})
            took = time.perf_counter() - t0
            if r.status_code != 200:
                why = r.json()["error"]["message"]
                return f"{uploaded}; create {r.status_code}: {why.split(' has ', 1)[-1][-80:]}", took
            batch_id, t0 = r.json()["id"], time.monotonic()
            seen: dict = {}

            async def status(*wanted: str, rows: int = 0) -> bool:
                seen.update((await client.get(f"/v1/batches/{batch_id}")).json())
                return seen["status"] in wanted and seen["request_counts"]["completed"] >= rows

            await _until(lambda: status(*FINAL, "in_progress"), 1800)
            validated = time.monotonic() - t0
            total = seen["request_counts"]["total"]
            await _until(lambda: status(*FINAL), run_s)
            ran = seen["request_counts"]["completed"]
            await client.post(f"/v1/batches/{batch_id}/cancel")
            t1 = time.monotonic()
            await _until(lambda: status(*FINAL), 600)
            return (f"{uploaded}; create 200; checked {total} lines in {validated:.0f} s, {ran} rows run in "
                    f"{run_s:.0f} s; cancel: {seen['status']} in {time.monotonic() - t1:.0f} s"), took

    return attack
