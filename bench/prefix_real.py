"""`sluice bench prefix --real`: prefix affinity on this machine's real engine (issue 34).

Per mode (affinity off, on), a fresh stack: a private Redis, two workers of the default model
with a KV cache of `kv_gib` (small enough that one worker cannot hold every system prompt), one
api. The chat workload (bench/prefix_workload.py: 8 shared system prompts of about 500 tokens,
Zipf, short user turns) is sent over /v1/chat/completions with `stream: true`, `concurrency` at
once, each asking for exactly `max_tokens` tokens (ignore_eos). Measured: the prefix-cache hit
rate from the workers' vLLM counters (their heartbeats, the warm-up excluded), against the
oracle's: the same prompts in the same order, each sent to the worker whose cache holds most of
it, over caches of the workers' real size (bench/prefix_sim.py best_worker_hit_rate), and
against one cache holding every system prompt (a bar no two caches of this size reach); TTFT p50/p99 (to the
first content chunk, at the client); output tokens/s; each worker's share of the requests (from
the inference log).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import redis

from sluice.bench.prefix_sim import best_worker_hit_rate
from sluice.bench.prefix_workload import chat_workload
from sluice.bench.sse import sse_events
from sluice.broker.keys import WORKERS, ModelKeys
from sluice.broker.plumbing.decoded import hash_of, stream_entries
from sluice.config.engine import DEFAULT_BLOCK_SIZE
from sluice.supervisor.stack import LocalStack

MODEL = "smol"
# Each worker's KV cache: 15 blocks of 128 tokens (vLLM's block on the CPU), in float32: four of
# the eight system prompts (3 full blocks each) and a few running requests, not all eight.
KV_GIB = 0.085
CPU_BLOCK_SIZE = 128
WORKER_NAMES = ["w0", "w1"]


def models_yaml(affinity: bool, kv_gib: float, concurrency: int) -> str:
    return (f"models:\n  - name: {MODEL}\n    prefix_affinity: {str(affinity).lower()}\n"
            f"    framework_config: {{dtype: float32, enforce_eager: true, max_model_len: 1024,\n"
            f"                        cpu_kvcache_space_gib: {kv_gib}}}\n"
            f"    continuous_batching_config: {{max_concurrent_batch_size: {concurrency}}}\n")


def _counters(client: redis.Redis) -> dict[str, tuple[int, int, tuple[int | None, int | None]]]:
    """Each live worker's prefix-cache (queries, hits, (its size in blocks, their size in tokens))
    from its last heartbeat."""
    out = {}
    for name, raw in hash_of(client.hgetall(WORKERS)).items():
        info = json.loads(raw)
        out[name] = (info.get("prefix_cache_queries") or 0, info.get("prefix_cache_hits") or 0,
                     (info.get("prefix_cache_blocks"), info.get("prefix_cache_block_size")))
    return out


def _shares(client: redis.Redis) -> dict[str, int]:
    """Requests per worker, from the inference log (a record's batch id starts with its worker's name)."""
    counts: dict[str, int] = {}
    for _, entry in stream_entries(client.xrange(ModelKeys(MODEL).log)):
        name = json.loads(entry["data"])["batch_id"].split("-", 1)[0]
        counts[name] = counts.get(name, 0) + 1
    return counts


async def _one(http: httpx.AsyncClient, messages: list[dict[str, str]], max_tokens: int) -> float:
    """TTFT of one streamed chat completion (seconds to its first content chunk); runs it to its end."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}
    t0, first = time.monotonic(), None
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for ev in sse_events(r):
            if ev.data.strip() == "[DONE]":
                break
            delta = json.loads(ev.data)["choices"][0].get("delta", {})
            if first is None and delta.get("content"):
                first = time.monotonic() - t0
    assert first is not None, "the stream ended without content"
    return first


async def _oracles(http: httpx.AsyncClient, chats: list[list[dict[str, str]]],
                   cache: tuple[int | None, int | None]) -> tuple[float, float | None]:
    """Two bars for the hit rate: (1) every repeat of a system prompt finds all its full blocks
    cached, as if one cache held all eight (no two caches of this size can); (2) the issue's
    oracle, each request sent to the worker whose cache holds most of it, with caches of the
    workers' real size and blocks (`cache`: their vLLM's num_gpu_blocks and block_size, 128 tokens
    on the CPU; None when not reported)."""
    shared: dict[str, int] = {}
    seen: set[str] = set()
    prompts: list[list[int]] = []
    hits = total = 0
    for chat in chats:
        system = chat[0]["content"]
        if system not in shared:
            body = {"model": MODEL, "messages": chat[:1], "add_generation_prompt": False}
            r = await http.post("/tokenize", json=body)
            r.raise_for_status()
            shared[system] = r.json()["count"] // DEFAULT_BLOCK_SIZE * DEFAULT_BLOCK_SIZE
        tokenized = await http.post("/tokenize", json={"model": MODEL, "messages": chat})
        prompts.append(tokenized.json()["tokens"])
        n = len(prompts[-1])
        total += n
        if system in seen:
            hits += min(shared[system], n - 1)
        seen.add(system)
    blocks, block_size = cache
    best = None
    if blocks and block_size:
        best = best_worker_hit_rate(prompts, len(WORKER_NAMES), blocks, block_size)
    return (hits / total if total else 0.0), best


async def _drive(url: str, chats: list[list[dict[str, str]]], concurrency: int, max_tokens: int
                 ) -> tuple[list[float], float]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        async def run(chat: list[dict[str, str]]) -> float:
            async with sem:
                return await _one(http, chat, max_tokens)

        t0 = time.monotonic()
        ttfts = await asyncio.gather(*(run(c) for c in chats))
        return list(ttfts), time.monotonic() - t0


def run_mode(affinity: bool, *, requests: int, concurrency: int, max_tokens: int, kv_gib: float, zipf: float,
             seed: int, heartbeat_s: float = 2.0, data_dir: Path | None = None) -> dict[str, Any]:
    """One stack, one workload; the figures of this mode. `data_dir` keeps the stack's logs."""
    chats = chat_workload(requests, zipf=zipf, seed=seed)
    yaml = models_yaml(affinity, kv_gib, concurrency)
    with tempfile.TemporaryDirectory() as tmp, LocalStack(data_dir or Path(tmp), models_yaml=yaml,
                                                          output="logs",
                                                          env={"VLLM_LOGGING_LEVEL": "WARNING"}) as stack:
        stack.up([MODEL, MODEL], names=WORKER_NAMES, timeout_s=1800)
        assert stack.redis_url is not None  # up() started Redis
        client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
        asyncio.run(_drive(stack.url, chat_workload(1, seed=seed + 1), 1, 2))  # both paths warm, not counted
        time.sleep(2 * heartbeat_s)
        before, logged = _counters(client), _shares(client)
        ttfts, wall_s = asyncio.run(_drive(stack.url, chats, concurrency, max_tokens))
        time.sleep(2 * heartbeat_s)  # the last heartbeats carry the last counters
        after, shares = _counters(client), _shares(client)

        cache = min((c[2] for c in after.values() if c[2][0]), default=(None, None))

        async def oracles() -> tuple[float, float | None]:
            async with httpx.AsyncClient(base_url=stack.url, timeout=60) as http:
                return await _oracles(http, chats, cache)

        one_cache, best_worker = asyncio.run(oracles())
        client.close()
    queries = sum(after[w][0] - before.get(w, (0, 0))[0] for w in after)
    hits = sum(after[w][1] - before.get(w, (0, 0))[1] for w in after)
    rate = hits / queries if queries else None
    served = {w: shares.get(w, 0) - logged.get(w, 0) for w in WORKER_NAMES}
    ordered = sorted(ttfts)
    return {"affinity": affinity, "requests": requests,
            "hit_rate": round(rate, 3) if rate is not None else None,
            "kv_cache": f"{cache[0]} x {cache[1]} tokens",
            "oracle_hit_rate": round(best_worker, 3) if best_worker is not None else None,
            "of_oracle": round(rate / best_worker, 3) if rate is not None and best_worker else None,
            "one_cache_hit_rate": round(one_cache, 3),
            "ttft_p50_ms": round(1000 * statistics.median(ordered), 1),
            "ttft_p99_ms": round(1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 1),
            "output_tokens_per_s": round(requests * max_tokens / wall_s, 1),
            "shares": served, "share_max/mean": round(max(served.values()) / (sum(served.values()) / 2), 2)
            if sum(served.values()) else None}
