"""`sluice bench soak`: steady mixed traffic against null-engine workers with a short
retention, sampling what the stack holds, to show that memory levels off once finished work
starts expiring as fast as it arrives (steady state = rate x retention x bytes per request).

The stack is private: one redis-server, a continuous and a dynamic model with one null worker
each, one api and one jobs worker. The traffic: interactive submit-and-poll, streamed OpenAI
completions, multi-row infer on the dynamic model, and a small bulk job every so often.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import redis as redis_sync
import typer

from sluice.supervisor.stack import LocalStack

MODELS = """models:
  - name: soak-cont
    continuous_batching_config: {max_concurrent_batch_size: 32}
  - name: soak-dyn
    dynamic_batching_config: {max_batch_delay_ms: 10, batch_size_target: 4, batch_size_limit: 8}
"""
PROMPT = " ".join(f"word{i}" for i in range(40))
SAMPLE_EVERY_S = 10.0


@dataclass
class Sample:
    at: float  # seconds since the start of the load
    redis_bytes: int
    api_rss: int
    worker_rss: int
    files_bytes: int


@dataclass
class Counts:
    ok: dict[str, int] = field(default_factory=lambda: {"poll": 0, "stream": 0, "infer": 0, "batch": 0})
    refused: int = 0
    errors: list[str] = field(default_factory=list)


class SoakStack:
    def __init__(self, tmp: Path, retention_s: int):
        ttl = str(retention_s)
        env = {"SLUICE_LOG_LEVEL": "WARNING", "SLUICE_RESULT_TTL_S": ttl, "SLUICE_FILE_TTL_S": ttl,
               "SLUICE_BATCH_TTL_S": ttl, "SLUICE_REPLY_TTL_S": str(max(retention_s // 6, 1)),
               "SLUICE_LOG_MAX_LEN": "1000", "SLUICE_NULL_TOKEN_DELAY_S": "0.001"}
        self.stack = LocalStack(tmp, MODELS, appendonly=False, env=env)
        self.stack.up(["soak-cont", "soak-dyn"], engine="null", jobs=True, timeout_s=120)
        self.files_dir = tmp / "data" / "files"
        self.url = self.stack.url
        assert self.stack.redis is not None
        self.redis = self.stack.redis
        self.api = next(iter(self.stack.apis.values()))
        self.workers = list(self.stack.workers.values())

    def sample(self, at: float) -> Sample:
        r = redis_sync.Redis.from_url(self.redis.url)
        try:
            used = int(r.info("memory")["used_memory"])
        finally:
            r.close()
        files = sum(p.stat().st_size for p in self.files_dir.glob("*")) if self.files_dir.is_dir() else 0
        return Sample(at, used, _rss(self.api.pid), _rss(self.workers[0].pid), files)

    def per_request_bytes(self) -> dict[str, float]:
        """Mean MEMORY USAGE of the finished requests' status hashes and reply streams held now."""
        r = redis_sync.Redis.from_url(self.redis.url, decode_responses=True)
        try:
            out = {}
            for kind in ("status", "reply"):
                found = r.scan_iter(f"sluice:{{m:soak-cont}}:{kind}:*", count=500)
                keys = [k for _, k in zip(range(200), found)]  # the first 200
                sizes = [r.memory_usage(k) or 0 for k in keys]
                out[kind] = sum(sizes) / len(sizes) if sizes else 0.0
            return out
        finally:
            r.close()

    def stop(self) -> None:
        self.stack.stop(timeout_s=15)


def _rss(pid: int) -> int:
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return 0


class Traffic:
    """`clients` loops per kind of traffic, each pacing itself to `rate` requests/s in all."""

    def __init__(self, url: str, rate: float, batch_every_s: float):
        self.url, self.rate, self.batch_every_s = url, rate, batch_every_s
        self.counts = Counts()

    async def run(self, seconds: float) -> Counts:
        stop = time.monotonic() + seconds
        async with httpx.AsyncClient(base_url=self.url, timeout=60) as http:
            kinds = [self._poll, self._poll, self._stream, self._infer]
            interval = len(kinds) / self.rate
            await asyncio.gather(*(self._loop(http, k, interval, stop) for k in kinds),
                                 self._batches(http, stop))
        return self.counts

    async def _loop(self, http: httpx.AsyncClient, one, interval: float, stop: float) -> None:
        while time.monotonic() < stop:
            started = time.monotonic()
            try:
                await one(http)
            except (httpx.HTTPError, KeyError, ValueError) as err:
                self.counts.errors.append(f"{one.__name__}: {type(err).__name__}: {err}"[:200])
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    def _answer(self, kind: str, response: httpx.Response) -> dict | None:
        if response.status_code == 503:
            self.counts.refused += 1
            return None
        response.raise_for_status()
        self.counts.ok[kind] += 1
        return response.json() if kind != "stream" else {}

    async def _poll(self, http: httpx.AsyncClient) -> None:
        sent = await http.post("/v1/requests",
                               json={"model": "soak-cont", "prompt": PROMPT, "max_tokens": 64})
        if sent.status_code == 503:
            self.counts.refused += 1
            return
        sent.raise_for_status()
        done = await http.get(f"/v1/requests/{sent.json()['id']}", params={"wait": 30})
        if self._answer("poll", done) and done.json()["status"] != "done":
            self.counts.errors.append(f"poll: {done.json()['status']}")

    async def _stream(self, http: httpx.AsyncClient) -> None:
        body = {"model": "soak-cont", "prompt": PROMPT, "max_tokens": 64, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code == 200:
                async for _ in response.aiter_lines():
                    pass
            self._answer("stream", response)

    async def _infer(self, http: httpx.AsyncClient) -> None:
        rows = [{"prompt": PROMPT, "max_tokens": 64} for _ in range(4)]
        self._answer("infer", await http.post("/v1/models/soak-dyn/infer", json=rows))

    async def _batches(self, http: httpx.AsyncClient, stop: float) -> None:
        while time.monotonic() < stop:
            body = {"model": "soak-cont", "prompt": PROMPT, "max_tokens": 64}
            lines = "".join(json.dumps({"custom_id": f"row-{i}", "method": "POST", "url": "/v1/completions",
                                        "body": body}) + "\n"
                            for i in range(40))
            try:
                up = await http.post("/v1/files", data={"purpose": "batch"},
                                     files={"file": ("in.jsonl", lines)})
                up.raise_for_status()
                made = await http.post("/v1/batches", json={"input_file_id": up.json()["id"],
                                                            "endpoint": "/v1/completions"})
                made.raise_for_status()
                ended = time.monotonic() + 120
                while time.monotonic() < ended:
                    batch = (await http.get(f"/v1/batches/{made.json()['id']}")).json()
                    if batch["status"] == "completed":
                        self.counts.ok["batch"] += 1
                        break
                    if batch["status"] in ("failed", "expired", "cancelled"):
                        self.counts.errors.append(f"batch: {batch['status']}")
                        break
                    await asyncio.sleep(1)
            except (httpx.HTTPError, KeyError) as err:
                self.counts.errors.append(f"batch: {type(err).__name__}: {err}"[:200])
            await asyncio.sleep(self.batch_every_s)


def growth_per_minute(samples: list[Sample], attr: str) -> tuple[float, float]:
    """(least-squares slope in bytes per minute, mean level in bytes) over the samples given."""
    xs = [s.at / 60 for s in samples]
    ys = [float(getattr(s, attr)) for s in samples]
    if len(xs) < 2:
        return 0.0, ys[0] if ys else 0.0
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my


def soak(minutes: float, retention_s: int, rate: float, warmup_s: float | None = None,
         sample_every_s: float = SAMPLE_EVERY_S, batch_every_s: float = 20) -> dict:
    """Run the soak; returns the samples, the growth after warm-up, and the traffic counts."""
    warmup = warmup_s if warmup_s is not None else 2 * retention_s
    samples: list[Sample] = []
    with tempfile.TemporaryDirectory() as tmp:
        stack = SoakStack(Path(tmp), retention_s)
        try:
            t0, done = time.monotonic(), threading.Event()

            def sampler() -> None:
                while not done.wait(sample_every_s):
                    samples.append(stack.sample(time.monotonic() - t0))

            thread = threading.Thread(target=sampler, daemon=True, name="soak-sampler")
            thread.start()
            counts = asyncio.run(Traffic(stack.url, rate, batch_every_s=batch_every_s).run(minutes * 60))
            done.set()  # samples of a stack without load would end the curve with a drop
            thread.join()
            per_request = stack.per_request_bytes()
        finally:
            stack.stop()
    steady = [s for s in samples if s.at >= warmup]
    growth = {}
    for attr in ("redis_bytes", "api_rss", "worker_rss", "files_bytes"):
        slope, level = growth_per_minute(steady, attr)
        growth[attr] = {"per_minute": slope, "level": level,
                        "percent_per_minute": 100 * slope / level if level else 0.0}
    return {"minutes": minutes, "retention_s": retention_s, "rate": rate, "warmup_s": warmup,
            "samples": [s.__dict__ for s in samples], "growth": growth, "per_request_bytes": per_request,
            "ok": counts.ok, "refused": counts.refused, "errors": counts.errors[:20],
            "error_count": len(counts.errors)}


def soak_command(
    minutes: float = typer.Option(10, help="Minutes of steady load."),
    retention: int = typer.Option(60, help="Seconds a finished request, file or batch is kept (short: so the "
                                           "steady state comes within the run)."),
    rate: float = typer.Option(20, help="Requests per second offered (polled, streamed, multi-row infer)."),
    json_out: Path = typer.Option(None, "--json", help="Write the samples and figures here."),
) -> None:
    """Steady mixed traffic for N minutes; prints Redis used_memory, the api's and a worker's RSS
    and the files folder every 10 s, and their growth per minute after the warm-up (2 x retention)."""
    result = soak(minutes, retention, rate)
    for s in result["samples"]:
        typer.echo(f"{s['at']:6.0f} s  redis {s['redis_bytes'] / 2**20:7.2f} MiB  "
                   f"api {s['api_rss'] / 2**20:7.1f} MiB  worker {s['worker_rss'] / 2**20:7.1f} MiB  "
                   f"files {s['files_bytes'] / 1024:8.1f} KiB")
    typer.echo(f"after {result['warmup_s']:.0f} s of warm-up, growth per minute:")
    for name, g in result["growth"].items():
        typer.echo(f"  {name:12s} {g['per_minute'] / 1024:+10.1f} KiB/min  "
                   f"({g['percent_per_minute']:+.2f}% of {g['level'] / 2**20:.2f} MiB)")
    typer.echo(f"bytes per finished request held now: status {result['per_request_bytes']['status']:.0f}, "
               f"reply stream {result['per_request_bytes']['reply']:.0f}")
    typer.echo(f"done: {result['ok']}, refused {result['refused']}, errors {result['error_count']}")
    if json_out:
        json_out.write_text(json.dumps(result, indent=2))
