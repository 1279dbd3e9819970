"""The load generator behind `sluice bench serve`, in the style of `vllm bench serve`.

Three targets share one driver: the Sluice api (submit + SSE events), vLLM's
AsyncLLMEngine in this process, and any OpenAI-style URL (streamed /v1/completions).
Arrivals are Poisson or fixed-rate, or a concurrency cap; prompt and output lengths are
drawn uniformly from ranges, from a seed, so every target gets the same requests.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp

from sluice.bench.sse import aevents

WORDS = ("river stone light garden window silver market engine harbor forest signal winter paper "
         "candle bridge orbit meadow copper lantern valley").split()


@dataclass
class LoadRequest:
    prompt: str
    max_tokens: int


@dataclass
class Record:
    ok: bool = False
    start: float = 0.0
    ttft: float | None = None
    token_times: list[float] = field(default_factory=list)
    end: float = 0.0
    output_tokens: int = 0
    queue_wait: float | None = None  # Sluice only: enqueued -> started on a worker
    error: str | None = None


Send = Callable[[LoadRequest], Awaitable[Record]]


def make_requests(n: int, prompt_words: tuple[int, int], output_tokens: tuple[int, int],
                  seed: int) -> list[LoadRequest]:
    rng = random.Random(seed)
    return [LoadRequest(" ".join(rng.choice(WORDS) for _ in range(rng.randint(*prompt_words))),
                rng.randint(*output_tokens)) for _ in range(n)]


async def drive(send: Send, requests: list[LoadRequest], *, rate: float | None, poisson: bool,
                concurrency: int | None, seed: int) -> tuple[list[Record], float]:
    """Send the requests with the arrival process (rate: requests/s) and/or a concurrency cap."""
    rng = random.Random(seed + 1)
    sem = asyncio.Semaphore(concurrency) if concurrency else None

    async def one(request: LoadRequest) -> Record:
        if sem is None:
            return await send(request)
        async with sem:
            return await send(request)

    t0 = time.perf_counter()
    tasks = []
    for request in requests:
        tasks.append(asyncio.create_task(one(request)))
        if rate:
            await asyncio.sleep(rng.expovariate(rate) if poisson else 1.0 / rate)
    records = await asyncio.gather(*tasks)
    return list(records), time.perf_counter() - t0


def percentile(xs: list[float], p: float) -> float | None:
    """The p-th percentile (nearest rank), None for no data."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def p50_p99(xs: list[float], unit: str = "s", scale: float = 1.0) -> dict[str, float | None]:
    return {f"p{p}_{unit}": (v * scale if (v := percentile(xs, p)) is not None else None) for p in (50, 99)}


def summarize(records: list[Record], wall: float, *, slo_ttft_s: float, slo_tpot_s: float) -> dict:
    ok = [r for r in records if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [(r.end - r.start - r.ttft) / (r.output_tokens - 1)
            for r in ok if r.ttft is not None and r.output_tokens > 1]
    itl = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:])]
    e2e = [r.end - r.start for r in ok]
    queue = [r.queue_wait for r in ok if r.queue_wait is not None]
    good = [r for r in ok if r.ttft is not None and r.ttft <= slo_ttft_s and (
        r.output_tokens <= 1 or (r.end - r.start - r.ttft) / (r.output_tokens - 1) <= slo_tpot_s)]
    out: dict = {"requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
                 "wall_s": wall, "request_throughput": len(ok) / wall,
                 "output_token_throughput": sum(r.output_tokens for r in ok) / wall,
                 "goodput": len(good) / wall, "slo": {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s}}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("queue_wait", queue), ("e2e", e2e)):
        out[name] = ({f"p{p}": percentile(xs, p) for p in (50, 90, 99)}
                     | {"mean": statistics.fmean(xs) if xs else None})
    return out


class _Session:
    """One aiohttp session per event loop, made on first use (vLLM's benchmark client is aiohttp
    too: it costs the machine a fraction of httpx's CPU per streamed line, which on a small
    machine is taken from the server being measured)."""

    def __init__(self, url: str, headers: dict[str, str] | None = None):
        self.url, self.headers = url.rstrip("/"), headers or {}
        self._session: aiohttp.ClientSession | None = None

    def __call__(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                headers=self.headers, timeout=aiohttp.ClientTimeout(total=None, sock_read=600, connect=30),
                connector=aiohttp.TCPConnector(limit=1024, limit_per_host=1024), read_bufsize=2**20)
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


@dataclass(frozen=True)
class _SessionSend:
    """A sender with a session of its own, which `close` closes."""

    send: Send
    session: _Session

    def __call__(self, request: LoadRequest) -> Awaitable[Record]:
        return self.send(request)

    async def aclose(self) -> None:
        await self.session.aclose()


async def close(send: Send) -> None:
    """Close a sender's connections (a sender without any has no `aclose`)."""
    aclose = getattr(send, "aclose", None)
    if aclose is not None:
        await aclose()


def sluice_sender(url: str, model: str | None) -> Send:
    session = _Session(url)

    async def send(request: LoadRequest) -> Record:
        rec = Record(start=time.perf_counter())
        body = {"prompt": request.prompt, "max_tokens": request.max_tokens, "temperature": 0.0,
                "ignore_eos": True}
        if model:
            body["model"] = model
        async with session().post(f"{session.url}/v1/requests", json=body) as r:
            if r.status != 202:
                rec.error, rec.end = f"{r.status}: {(await r.text())[:200]}", time.perf_counter()
                return rec
            rid = (await r.json())["id"]
        async with session().get(f"{session.url}/v1/requests/{rid}/events") as response:
            async for ev in aevents(response.content):
                if ev.event == "delta":
                    now = time.perf_counter()
                    rec.ttft = rec.ttft if rec.ttft is not None else now - rec.start
                    rec.token_times.append(now)
                elif ev.event in ("done", "error"):
                    final = ev.json()
                    rec.end = time.perf_counter()
                    rec.ok = ev.event == "done"
                    rec.output_tokens = (final.get("output") or {}).get("num_output_tokens", 0)
                    t = final.get("timings") or {}
                    if t.get("started") and t.get("enqueued"):
                        rec.queue_wait = t["started"] - t["enqueued"]
                    rec.error = final.get("error")
                    break
        return rec

    return _SessionSend(send, session)


def openai_sender(url: str, model: str, api_key: str | None = None) -> Send:
    session = _Session(url, {"Authorization": f"Bearer {api_key}"} if api_key else None)

    async def send(request: LoadRequest) -> Record:
        rec = Record(start=time.perf_counter())
        body = {"model": model, "prompt": request.prompt, "max_tokens": request.max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        async with session().post(f"{session.url}/v1/completions", json=body) as response:
            if response.status != 200:
                rec.error, rec.end = f"{response.status}", time.perf_counter()
                return rec
            async for ev in aevents(response.content):
                if ev.data == "[DONE]":
                    break
                chunk = ev.json()
                if chunk.get("usage"):
                    rec.output_tokens = chunk["usage"]["completion_tokens"]
                if any(c.get("text") for c in chunk.get("choices", [])):
                    now = time.perf_counter()
                    rec.ttft = rec.ttft if rec.ttft is not None else now - rec.start
                    rec.token_times.append(now)
        rec.end, rec.ok = time.perf_counter(), True
        rec.output_tokens = rec.output_tokens or len(rec.token_times)
        return rec

    return _SessionSend(send, session)


def engine_sender(engine) -> Send:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    counter = iter(range(10**12))

    async def send(request: LoadRequest) -> Record:
        rec = Record(start=time.perf_counter())
        params = SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        async for out in engine.generate(request.prompt, params, request_id=f"bench-{next(counter)}"):
            ids = out.outputs[0].token_ids
            if ids:
                now = time.perf_counter()
                rec.ttft = rec.ttft if rec.ttft is not None else now - rec.start
                rec.token_times.append(now)
                rec.output_tokens += len(ids)
        rec.end, rec.ok = time.perf_counter(), True
        return rec

    return send
