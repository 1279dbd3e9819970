"""`sluice bench webhooks`: how soon a client hears of a final by webhook, against long-polling.

One stack (Redis, one api, one null-engine worker, one webhook sender) and a receiver on loopback
in this process. Phase 1: `requests` requests, each watched by a `GET ?wait=` long-poll while the
endpoint receives its event; per request the delay from the final (the worker's `finished`) to
the poll's answer and to the webhook's receipt (p50, p99). Phase 2: the sender stopped while
`requests` more requests end, then started again: the events per second one sender delivers
from a full outbox, against the answers per second of as many `?wait=` polls of finished
requests at `concurrency` at once."""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import typer
from aiohttp import web

from sluice.supervisor.stack import LocalStack

MODEL = "echo"
MODELS = f"models:\n  - name: {MODEL}\n    max_queued: 1000000\n"
ENV = {"SLUICE_LOG_LEVEL": "ERROR", "SLUICE_WEBHOOKS_ALLOW_PRIVATE": "1"}


class Inbox:
    """Receipt times by request id (the first receipt of each event)."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}
        self.posts = 0  # every receipt: more than the events when an attempt was retried
        self.changed = asyncio.Event()

    async def handle(self, request: web.Request) -> web.Response:
        event = json.loads(await request.read())
        self.posts += 1
        self.at.setdefault(event["data"].get("id", ""), time.time())
        self.changed.set()
        return web.Response(status=204)

    async def until(self, ids: set[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not ids <= self.at.keys():
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), max(deadline - time.monotonic(), 0.01))


def _pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1000 if len(values) > 1 else 0.0


async def _submit(client: httpx.AsyncClient, n: int, concurrency: int) -> list[str]:
    gate, ids = asyncio.Semaphore(concurrency), []

    async def one(i: int) -> None:
        async with gate:
            r = await client.post("/v1/requests",
                                  json={"model": MODEL, "prompt": f"hook {i}", "max_tokens": 4})
            r.raise_for_status()
            ids.append(r.json()["id"])

    await asyncio.gather(*(one(i) for i in range(n)))
    return ids


async def _poll(client: httpx.AsyncClient, rid: str) -> tuple[float, float]:
    """(the final's time, when the long-poll answered it)."""
    r = await client.get(f"/v1/requests/{rid}", params={"wait": 30})
    answered = time.time()
    return float(r.json()["timings"]["finished"]), answered


async def _measure(stack: LocalStack, requests: int, concurrency: int) -> dict:
    inbox = Inbox()
    app = web.Application()
    app.router.add_post("/hooks", inbox.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]  # the port the system chose
    limits = httpx.Limits(max_connections=concurrency * 2)
    try:
        async with httpx.AsyncClient(base_url=stack.url, timeout=60, limits=limits) as client:
            hooked = await client.post("/v1/webhooks", json={"url": f"http://127.0.0.1:{port}/hooks"})
            hooked.raise_for_status()
            await asyncio.sleep(2.5)  # the api's cache of owners with an endpoint (2 s)
            # Phase 1: a long-poll per request, and its webhook
            gate = asyncio.Semaphore(concurrency)

            async def watched(i: int) -> tuple[str, float, float]:
                async with gate:
                    r = await client.post("/v1/requests",
                                          json={"model": MODEL, "prompt": f"w {i}", "max_tokens": 4})
                    rid = r.json()["id"]
                    finished, answered = await _poll(client, rid)
                    return rid, finished, answered

            watched_all = await asyncio.gather(*(watched(i) for i in range(requests)))
            await inbox.until({rid for rid, _, _ in watched_all}, 60)
            poll_lat = [a - f for _, f, a in watched_all]
            hook_lat = [inbox.at[rid] - f for rid, f, _ in watched_all]
            # Phase 2: a full outbox, one sender
            assert stack.webhooks is not None
            stack.webhooks.terminate()
            stack.webhooks.wait(30)
            ids = await _submit(client, requests, concurrency)
            await asyncio.gather(*(_poll(client, rid) for rid in ids))  # all final (and the api warm)
            t0 = time.perf_counter()
            sem = asyncio.Semaphore(concurrency)

            async def polled(rid: str) -> None:
                async with sem:
                    await _poll(client, rid)

            await asyncio.gather(*(polled(rid) for rid in ids))
            poll_rate = len(ids) / (time.perf_counter() - t0)
            started = time.time()
            stack.start_webhooks()
            await inbox.until(set(ids), 120)
            first = min(inbox.at[r] for r in ids)
            hook_rate = len(ids) / max(max(inbox.at[r] for r in ids) - first, 1e-6)
            startup = first - started
    finally:
        await runner.cleanup()
    return {"requests": requests, "concurrency": concurrency,
            "webhook_latency_ms": {"p50": _pct(hook_lat, 50), "p99": _pct(hook_lat, 99)},
            "poll_latency_ms": {"p50": _pct(poll_lat, 50), "p99": _pct(poll_lat, 99)},
            "webhook_events_per_s": hook_rate, "poll_answers_per_s": poll_rate,
            "sender_start_to_first_event_s": startup, "posts": inbox.posts, "events": len(inbox.at)}


def webhooks(requests: int = typer.Option(500, metavar="N", help="Requests per phase."),
             concurrency: int = typer.Option(16, metavar="N", help="Clients at once."),
             out: Path | None = typer.Option(None, metavar="FILE",
                                             help="Also write the report here (JSON).")) -> None:
    """Webhook delivery against ?wait= long-polling: latency from final to receipt, and rate."""
    with tempfile.TemporaryDirectory() as tmp, LocalStack(Path(tmp), MODELS, env=ENV, output="logs") as stack:
        stack.up([MODEL], engine="null", timeout_s=300)
        stack.start_webhooks()
        report = asyncio.run(_measure(stack, requests, concurrency))
        if report["posts"] > report["events"]:
            log_tail = (Path(tmp) / "logs" / "webhooks.log").read_text()[-2000:]
            typer.echo(f"{report['posts'] - report['events']} events were posted again; "
                       f"the sender's log ends:\n{log_tail}", err=True)
    w, p = report["webhook_latency_ms"], report["poll_latency_ms"]
    typer.echo(f"final -> receipt, {requests} requests at {concurrency} at once: "
               f"webhook p50 {w['p50']:.1f} ms, p99 {w['p99']:.1f} ms; "
               f"?wait= poll p50 {p['p50']:.1f} ms, p99 {p['p99']:.1f} ms")
    typer.echo(f"one sender from a full outbox: {report['webhook_events_per_s']:.0f} events/s; "
               f"?wait= polls of finished requests: {report['poll_answers_per_s']:.0f} answers/s")
    if out:
        out.write_text(json.dumps(report, indent=2))
