"""`sluice bench fairness`: tenants' fair share of one model, against plain FIFO, through the api.

A local stack (Redis, api, one worker of `--slots` continuous-batching slots) serves model
`echo` with the null engine at a realistic pace: `--prefill-ms` before a request's first token,
then one token every `--token-ms`. Its capacity, in requests of tenant a's shape, is slots over a
request's duration. Tenants are keys of a keys file (SLUICE_KEYS_FILE), so every request goes
the api's way: key -> tenant -> admission (queue share) -> staging -> dispatch -> worker.

Runs, each on a fresh stack, each for `--seconds` of open-loop (Poisson) arrivals:
- `b alone`: tenant b offers 10 % of capacity with short outputs (`--b-tokens`);
- `fair`: tenant a offers 10 x capacity with long outputs (`--a-tokens`) beside b;
- `fifo`: the same with SLUICE_FAIR_SHARE=false (one FIFO queue: a's backlog is ahead of b);
- `equal` and `3:1`: a and b both offer 5 x capacity with long outputs, weights 1:1 and 3:1.

Printed per run and tenant: served tokens/s (prompt + output, counted as they are generated),
its share of the service (prompt + 2 x output, the Virtual Token Counter's units) overall and
its least and most over every 30 s window, TTFT p50/p99 (first token less admission), requests
refused (429/503), and the p99 of admission to start (the scheduler's part of the TTFT: the
rest is the engine's, and the machine's when its cores are busy); then b's TTFT p99 against b
alone and total throughput against FIFO. Targets (issue 31): b's p99 within 1.5 x of b alone;
equal weights 45-55 % in every window; 3:1 70-80 %; total throughput at least 0.97 of FIFO's.
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import redis
import typer

from sluice.api.auth import digest
from sluice.bench.fairness_figures import TenantFigures, figures_of
from sluice.broker.keys import ModelKeys
from sluice.supervisor.stack import LocalStack

MODEL = "echo"
PROMPT = "fair share " * 8  # 16 words: the null engine counts words as prompt tokens


@dataclass(frozen=True)
class Offer:
    tenant: str
    rate: float  # requests per second (Poisson)
    max_tokens: int
    weight: float = 1.0


@dataclass(frozen=True)
class RunShape:
    """One run's arrivals, worker and engine pace (the same for every run but the real one)."""

    seconds: float
    warm_s: float
    slots: int
    token_ms: float
    prefill_ms: float
    reserve: int
    engine: str
    drain_s: float


@dataclass
class Sent:
    tenant: str
    at: float
    rid: str | None = None
    refused: int = 0  # the status code of a refusal


async def _offer(url: str, key: str, offer: Offer, seconds: float, rng: random.Random,
                 out: list[Sent]) -> None:
    """Open-loop arrivals of one tenant for `seconds`: each request is sent when its time comes,
    whatever the earlier ones are doing."""
    async with httpx.AsyncClient(base_url=url, timeout=30, headers={"Authorization": f"Bearer {key}"},
                                 limits=httpx.Limits(max_connections=64)) as http:
        async def one(sent: Sent) -> None:
            try:
                r = await http.post("/v1/requests", json={"model": MODEL, "prompt": PROMPT,
                                                         "max_tokens": offer.max_tokens})
            except httpx.HTTPError:
                sent.refused = -1
                return
            if r.status_code == 202:
                sent.rid = r.json()["id"]
            else:
                sent.refused = r.status_code

        tasks, start = [], time.monotonic()
        due = start
        while True:
            due += rng.expovariate(offer.rate)
            if due - start > seconds:
                break
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            sent = Sent(offer.tenant, time.time())
            out.append(sent)
            tasks.append(asyncio.create_task(one(sent)))
        await asyncio.gather(*tasks)


def _keys_file(path: Path, offers: list[Offer]) -> dict[str, str]:
    """A keys file with one key per tenant (their weights); returns tenant -> key."""
    keys = {o.tenant: f"sk-bench-{o.tenant}-{secrets.token_hex(8)}" for o in offers}
    path.write_text(json.dumps({  # YAML is a superset of JSON
        "tenants": {o.tenant: {"weight": o.weight} for o in offers},
        "keys": [{"key": "sha256:" + digest(k), "tenant": t} for t, k in keys.items()],
    }))
    return keys


def _results(client: redis.Redis, sent: list[Sent]) -> dict[str, dict]:
    """The final results (timings, usage) of the admitted requests that finished."""
    keys = ModelKeys(MODEL)
    admitted = [s.rid for s in sent if s.rid]
    pipe = client.pipeline(transaction=False)
    for rid in admitted:
        pipe.hget(keys.status(rid), "result")
    return {rid: json.loads(raw) for rid, raw in zip(admitted, pipe.execute()) if raw}


def _models_yaml(shape: RunShape) -> str:
    engine_options = ("    framework_config: {dtype: float32, enforce_eager: true, max_model_len: 1024, "
                      "cpu_kvcache_space_gib: 1}\n") if shape.engine == "vllm" else ""
    return (f"models:\n  - name: {MODEL}\n{engine_options}"
            f"    continuous_batching_config: {{max_concurrent_batch_size: {shape.slots}}}\n"
            f"    request_timeout_s: 3600\n")


def _run(offers: list[Offer], *, fair: bool, shape: RunShape) -> dict[str, TenantFigures]:
    with tempfile.TemporaryDirectory() as tmp:
        keys = _keys_file(Path(tmp) / "keys.yaml", offers)
        env = {"SLUICE_LOG_LEVEL": "WARNING", "SLUICE_KEYS_FILE": str(Path(tmp) / "keys.yaml"),
               "SLUICE_FAIR_SHARE": "true" if fair else "false",
               "SLUICE_TENANT_RESERVED_SLOTS": str(shape.reserve),
               "SLUICE_NULL_TOKEN_DELAY_S": str(shape.token_ms / 1000),
               "SLUICE_NULL_DELAY_S": str(shape.prefill_ms / 1000)}
        with LocalStack(Path(tmp) / "stack", _models_yaml(shape), appendonly=False, env=env,
                        output="logs") as stack:
            try:
                stack.up(["echo"], engine=shape.engine, timeout_s=600)
            except RuntimeError:
                for log in sorted((Path(tmp) / "stack" / "logs").glob("*")):
                    tail = log.read_text(errors="replace").splitlines()[-60:]
                    typer.echo(f"--- {log.name}\n" + "\n".join(tail))
                raise
            assert stack.redis_url is not None  # up() started Redis
            client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
            sent: list[Sent] = []

            async def load() -> None:
                rng = random.Random(7)
                await asyncio.gather(*(_offer(stack.url, keys[o.tenant], o, shape.seconds,
                                              random.Random(rng.random()), sent)
                                       for o in offers))

            t0 = time.time()
            asyncio.run(load())
            t_end = time.time()
            time.sleep(shape.drain_s)  # what ran at the end finishes (its tokens inside the run count)
            results = _results(client, sent)
            client.close()
    return figures_of(sent, results, t0 + shape.warm_s, t_end)


def _show(label: str, figures: dict[str, TenantFigures]) -> None:
    typer.echo(f"\n{label}")
    typer.echo(f"  {'tenant':6} {'tokens/s':>9} {'share':>6} {'30s min':>8} {'30s max':>8} "
               f"{'TTFT p50':>9} {'TTFT p99':>9} {'queued p99':>10} {'sent':>6} {'done':>6} {'refused':>7}")
    for t, f in figures.items():
        def ms(v: float | None) -> str:
            return f"{v * 1000:.0f} ms" if v is not None else "-"
        wmin = min(f.window_shares) if f.window_shares else f.share
        wmax = max(f.window_shares) if f.window_shares else f.share
        typer.echo(f"  {t:6} {f.tokens_per_s:9.0f} {f.share:6.1%} {wmin:8.1%} {wmax:8.1%} "
                   f"{ms(f.ttft_p50):>9} {ms(f.ttft_p99):>9} {ms(f.queued_p99):>10} {f.sent:6} {f.done:6} "
                   f"{f.refused:7}")


def fairness(
    seconds: float = typer.Option(90.0, help="Arrivals per run (30 s windows inside it)."),
    warm_s: float = typer.Option(15.0, help="Left out of the figures at the start of each run."),
    slots: int = typer.Option(128, help="The worker's continuous-batching slots."),
    token_ms: float = typer.Option(50.0, help="Null engine: time per output token, per request."),
    prefill_ms: float = typer.Option(200.0, help="Null engine: time before a request's first token."),
    a_tokens: int = typer.Option(200, help="Tenant a's output tokens (long)."),
    b_tokens: int = typer.Option(8, help="Tenant b's output tokens (short)."),
    reserve: int = typer.Option(3, help="SLUICE_TENANT_RESERVED_SLOTS of the fair runs."),
    real: bool = typer.Option(False, "--real",
                              help="Also one short fair run with the real default model (vLLM)."),
    only: str = typer.Option("", help="Runs, comma-separated: b-alone,fair,fifo,equal,3:1,real "
                                      "(default: all but real)."),
    out: Path = typer.Option(None, help="Write the figures as JSON here."),
) -> None:
    """Tenant a floods a model, tenant b asks for a little: fair share against FIFO, and weights."""
    duration_s = (prefill_ms + a_tokens * token_ms) / 1000
    capacity = slots / duration_s  # requests of a's shape per second
    common = RunShape(seconds=seconds, warm_s=warm_s, slots=slots, token_ms=token_ms, prefill_ms=prefill_ms,
                      reserve=reserve, engine="null", drain_s=duration_s + 2)
    light = Offer("b", 0.1 * capacity, b_tokens)
    runs = {
        "b-alone": ([light], True),
        "fair": ([Offer("a", 10 * capacity, a_tokens), light], True),
        "fifo": ([Offer("a", 10 * capacity, a_tokens), light], False),
        "equal": ([Offer("a", 5 * capacity, a_tokens), Offer("b", 5 * capacity, a_tokens)], True),
        "3:1": ([Offer("a", 5 * capacity, a_tokens, 3.0), Offer("b", 5 * capacity, a_tokens)], True),
    }
    chosen = [r.strip() for r in only.split(",") if r.strip()] or list(runs)
    real = real or "real" in chosen
    typer.echo(f"capacity: {slots} slots / {duration_s:.2f} s = {capacity:.1f} requests/s of a's shape; "
               f"a offers 10 x, b 10 % ({light.rate:.2f}/s, {b_tokens} tokens); reserve {reserve} slot(s)")
    figures: dict[str, dict[str, TenantFigures]] = {}
    for name in [c for c in chosen if c != "real"]:
        offers, fair = runs[name]
        figures[name] = _run(offers, fair=fair, shape=common)
        _show(f"{name} ({'fair share' if fair else 'FIFO'}, weights "
              f"{':'.join(f'{o.weight:g}' for o in offers)})", figures[name])
    if real:
        offers = [Offer("a", 4.0, 64), Offer("b", 0.5, 8)]
        real_shape = replace(common, engine="vllm", seconds=60.0, warm_s=10.0, slots=8, drain_s=20.0)
        figures["real"] = _run(offers, fair=True, shape=real_shape)
        _show("real engine (vLLM, default model; fair share, a 4/s x 64 tokens, b 0.5/s x 8)",
              figures["real"])
    summary = _summary(figures)
    for line in summary:
        typer.echo(line)
    if out:
        by_run = {name: {t: vars(f) for t, f in run.items()} for name, run in figures.items()}
        out.write_text(json.dumps(by_run | {"summary": summary}, indent=2))


def _summary(figures: dict[str, dict[str, TenantFigures]]) -> list[str]:
    lines = ["\ntargets:"]
    alone = figures.get("b-alone", {}).get("b")
    for name in ("fair", "fifo"):
        b = figures.get(name, {}).get("b")
        if alone and b and alone.ttft_p99 and b.ttft_p99:
            lines.append(f"  {name}: b's TTFT p99 / b alone = {b.ttft_p99 / alone.ttft_p99:.2f} "
                         "(target <= 1.5)")
    if "fair" in figures and "fifo" in figures:
        fair = sum(f.tokens_per_s for f in figures["fair"].values())
        fifo = sum(f.tokens_per_s for f in figures["fifo"].values())
        lines.append(f"  throughput fair / FIFO = {fair / fifo:.3f} (target >= 0.97)")
    for name, low, high in (("equal", 0.45, 0.55), ("3:1", 0.70, 0.80)):
        a = figures.get(name, {}).get("a")
        if a:
            shares = a.window_shares or [a.share]
            ok = all(low <= s <= high for s in shares)
            lines.append(f"  {name}: a's share {a.share:.1%}, every 30 s window "
                         f"{min(shares):.1%}-{max(shares):.1%} "
                         f"(target {low:.0%}-{high:.0%}: {'met' if ok else 'missed'})")
    return lines
