"""The load of `sluice bench chaos`: clients that use Sluice the ways its users do.

Plain requests (POST /v1/requests with an Idempotency-Key, retried on either api) followed by
SSE readers or a long-poll; structured ones (a background POST /v1/responses, json_schema: a
retry regenerates the row from its start); multi-row ones (POST /v1/models/{m}/infer, 2-4 rows;
their id is read from Redis while the call waits, so readers can follow them). A followed request
has a reader from its start and, for a share, one joining mid-stream (a Responses stream for a
structured one); any reader may hang up once and resume (Last-Event-ID, starting_after): the
readers are bench/chaos_readers.py. With tenants (bench/chaos_tenants.py), client c sends every
call with the key of tenant c % N.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import redis.asyncio as redis_async

from sluice.bench.chaos_audit import Tracked
from sluice.bench.chaos_readers import Readers
from sluice.bench.chaos_tenants import Tenancy
from sluice.bench.prefix_workload import shared_preamble
from sluice.broker.keys import ModelKeys, staged
from sluice.broker.plumbing.decoded import stream_entries
from sluice.protocol.openai_responses import request_id

SUBMIT_TIMEOUT_S = 60.0  # a submit still unanswered after this long is given up (never counted as accepted)
KINDS = ("stream", "structured", "rows", "poll")
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}


@dataclass
class LoadFigures:
    tracked: list[Tracked] = field(default_factory=list)
    queue_full: int = 0  # 503 overloaded: refused, not accepted
    tenant_refused: int = 0  # 429 (a tenant's share of the queue, or a limit): refused, not accepted
    submit_gave_up: int = 0
    submit_retries: int = 0
    rows_unknown: int = 0  # multi-row calls not followed: refused, or broken off before their id was seen
    retry_reasons: Counter[str] = field(default_factory=Counter)  # why submits were sent again
    client_errors: list[str] = field(default_factory=list)


class Load(Readers):
    def __init__(self, urls: list[str], models: list[str], *, clients: int, seed: int,
                 max_tokens: tuple[int, int], hangups: float, late_readers: float = 0.5,
                 structured: float = 0.15, multi_row: float = 0.2, redis_url: str | None = None,
                 rows_model: str | None = None, tenancy: Tenancy | None = None):
        self.urls, self.models, self.clients, self.hangups = urls, models, clients, hangups
        self.late_readers, self.structured, self.multi_row = late_readers, structured, multi_row
        self.rows_model, self.tenancy = rows_model or models[-1], tenancy or Tenancy()
        self.redis = redis_async.Redis.from_url(redis_url, decode_responses=True) if redis_url else None
        self.rng, self.max_tokens, self.figures = random.Random(seed), max_tokens, LoadFigures()
        self.loading, self.follow_until = True, math.inf  # until then (monotonic), clients follow requests

    async def run(self, enough: Callable[[], bool], drain_s: float) -> LoadFigures:
        """Keep `clients` requests in flight until `enough()` (asked every 0.1 s); every client then
        follows its last request until it is final or `drain_s` passed. Every call of client c
        goes with the key of its tenant (one connection pool per tenant)."""
        timeout = httpx.Timeout(30, connect=3)
        limits = httpx.Limits(max_connections=8 * self.clients, max_keepalive_connections=2 * self.clients)
        async with contextlib.AsyncExitStack() as pools:
            tenants = {self.tenancy.of_client(c) for c in range(self.clients)}
            http = {t: await pools.enter_async_context(
                        httpx.AsyncClient(timeout=timeout, limits=limits, headers=self.tenancy.headers(t)))
                    for t in tenants}
            clients = [asyncio.create_task(self._client(http[self.tenancy.of_client(c)], c))
                       for c in range(self.clients)]
            while not enough():
                await asyncio.sleep(0.1)
            self.loading, self.follow_until = False, time.monotonic() + drain_s
            # A stream the api keeps open with pings would outlast the drain: the drain ends it.
            _, late = await asyncio.wait(clients, timeout=drain_s)
            for task in late:  # not followed to its final: the audit says whether it has one
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        return self.figures

    def _kind(self) -> str:
        roll = self.rng.random()
        if roll < self.structured:
            return "structured"
        if roll < self.structured + self.multi_row and self.redis is not None:
            return "rows"
        return "stream" if self.rng.random() < 0.6 else "poll"

    async def _client(self, http: httpx.AsyncClient, c: int) -> None:
        n = 0
        while self.loading:
            n += 1
            # A client's first request is of a kind fixed by the client, with both readers and a
            # hang-up: every kind and reader shows up even in a short run on a loaded machine.
            api, kind = self.rng.randrange(len(self.urls)), KINDS[c % len(KINDS)] if n == 1 else self._kind()
            kind = "stream" if kind == "rows" and self.redis is None else kind
            # Continuous batching takes one row per request: multi-row calls go to the dynamic model.
            model = self.rows_model if kind == "rows" else self.rng.choice(self.models)
            prompt = f"{shared_preamble(c % 3)}chaos client {c} request {n}"  # three prefix groups
            try:
                await self._one(http, api, model, kind, prompt, every_reader=n == 1,
                                tenant=self.tenancy.of_client(c))
            except Exception as err:  # a bench bug must not stop the load; it is reported
                self.figures.client_errors.append(f"{kind} {prompt}: {type(err).__name__}: {err}")

    async def _one(self, http: httpx.AsyncClient, api: int, model: str, kind: str, prompt: str,
                   every_reader: bool, tenant: str) -> None:
        if kind == "rows":
            return await self._rows(http, api, model, prompt, every_reader, tenant)
        tracked = await (self._structured(http, api, model, prompt) if kind == "structured"
                         else self._submit(http, api, model, prompt, kind))
        if tracked is None:
            return
        tracked.every_reader, tracked.tenant, tracked.owner = every_reader, tenant, self.tenancy.owner(tenant)
        self.figures.tracked.append(tracked)
        if kind == "poll":
            return await self._poll(http, tracked, api)
        await self._readers(http, tracked, api)

    async def _post(self, http: httpx.AsyncClient, api: int, path: str, body: dict | list,
                    headers: dict | None = None, timeout: float = 10) -> tuple[httpx.Response | None, int]:
        """POST until an answer that is not a 5xx of a dead api or Redis (the other api on a
        retry); (None, tries) once SUBMIT_TIMEOUT_S passed or it was refused (_refused)."""
        give_up, tries = time.monotonic() + SUBMIT_TIMEOUT_S, 0
        while time.monotonic() < give_up:
            tries += 1
            url = self.urls[(api + tries - 1) % len(self.urls)]  # a retry goes to the other api
            try:
                r = await http.post(f"{url}{path}", json=body, headers=headers or {}, timeout=timeout)
            except httpx.TransportError as err:
                r, _ = None, self.figures.retry_reasons.update([type(err).__name__])
            if r is not None and self._refused(r):
                await asyncio.sleep(0.5)
                return None, tries
            if r is not None and r.status_code < 500:
                if r.status_code >= 300:
                    self.figures.client_errors.append(f"{path} {r.status_code}: {r.text[:200]}")
                    return None, tries
                self.figures.submit_retries += tries - 1
                return r, tries
            if r is not None:
                self.figures.retry_reasons[f"{r.status_code} {r.text[:80]}"] += 1
            await asyncio.sleep(0.2)  # the api or Redis is down: again, on the other api
        self.figures.submit_gave_up += 1
        return None, tries

    def _refused(self, r: httpx.Response) -> bool:
        """Whether the api refused the call for good, nothing enqueued (counted, never accepted):
        503 overloaded (the queue is full) or 429 (the tenant's share of it, or a tenant limit)."""
        if r.status_code == 429:
            self.figures.tenant_refused += 1
        elif r.status_code == 503 and "overloaded" in r.text:
            self.figures.queue_full += 1
        return r.status_code == 429 or (r.status_code == 503 and "overloaded" in r.text)

    async def _submit(self, http: httpx.AsyncClient, api: int, model: str, prompt: str,
                      kind: str) -> Tracked | None:
        key = f"chaos-{uuid.uuid4().hex}"
        body = {"model": model, "prompt": prompt, "temperature": 0.0,
                "max_tokens": self.rng.randint(*self.max_tokens)}
        r, tries = await self._post(http, api, "/v1/requests", body, {"Idempotency-Key": key})
        return Tracked(r.json()["id"], model, kind, key, tries) if r is not None else None

    async def _structured(self, http: httpx.AsyncClient, api: int, model: str, prompt: str) -> Tracked | None:
        """A background response with a json_schema format (no Idempotency-Key on this route: a
        retry after a broken answer may admit a second one, which nobody follows)."""
        body = {"model": model, "input": prompt, "temperature": 0.0, "background": True,
                "max_output_tokens": self.rng.randint(*self.max_tokens),
                "text": {"format": {"type": "json_schema", "name": "chaos", "schema": SCHEMA}}}
        r, tries = await self._post(http, api, "/v1/responses", body, timeout=30)  # compiles its schema
        if r is None:
            return None
        return Tracked(request_id(r.json()["id"]) or "", model, "structured", None, tries)

    async def _rows(self, http: httpx.AsyncClient, api: int, model: str, prompt: str, every_reader: bool,
                    tenant: str) -> None:
        """A multi-row call: its id is looked up in the model's stream while the call waits;
        readers follow it, also when the call breaks off (its api died)."""
        marker = f"{prompt} {uuid.uuid4().hex[:8]}"
        rows = [{"prompt": f"{marker} row {i}", "max_tokens": self.rng.randint(*self.max_tokens)}
                for i in range(self.rng.randint(2, 4))]
        call = asyncio.create_task(self._infer(http, api, model, rows))
        readers: asyncio.Task | None = None
        try:
            rid = await self._find(model, marker, call, tenant)
            t = Tracked(rid or "", model, "rows", None, 1, rows=len(rows), every_reader=every_reader,
                        tenant=tenant, owner=self.tenancy.owner(tenant))
            if rid:
                self.figures.tracked.append(t)
                readers = asyncio.create_task(self._readers(http, t, api))
            r, t.submit_tries = await call
            if r is not None and r.status_code == 200 and not rid:
                t.rid = r.headers["X-Request-Id"]  # answered before its entry was seen
                self.figures.tracked.append(t)
            if r is not None and r.status_code == 200:
                t.answer = {i: rec.get("generated_text") or "" for i, rec in enumerate(r.json())}
            elif r is not None and not self._refused(r) and not rid:
                self.figures.client_errors.append(f"infer {r.status_code}: {r.text[:200]}")
            if not t.rid:
                self.figures.rows_unknown += 1
                return
            await (readers or self._readers(http, t, api))
        finally:
            call.cancel()
            _ = readers and readers.cancel()

    async def _infer(self, http: httpx.AsyncClient, api: int, model: str,
                     rows: list[dict]) -> tuple[httpx.Response | None, int]:
        """The infer call, sent again (to the other api) only when nothing reached an api: this
        route takes no Idempotency-Key, so a call broken off later may have been admitted."""
        give_up, tries = time.monotonic() + SUBMIT_TIMEOUT_S, 0
        while time.monotonic() < give_up:
            tries += 1
            url = self.urls[(api + tries - 1) % len(self.urls)]
            try:
                return await http.post(f"{url}/v1/models/{model}/infer", json=rows, timeout=300), tries
            except httpx.ConnectError:
                await asyncio.sleep(0.2)
            except httpx.TransportError:
                return None, tries
        return None, tries

    async def _find(self, model: str, marker: str, call: asyncio.Task, tenant: str) -> str | None:
        """The id of the entry whose first row's prompt starts with `marker`, read from the model's
        stream and its tenant's staged entries (fair share: waiting for their turn onto it) until
        the call is answered (None if it never showed)."""
        assert self.redis is not None
        lane = ModelKeys(model).requests
        while not call.done():
            try:
                # (staged first: an entry moves on, never back)
                for stream in (staged(lane, tenant), lane):
                    for _, f in stream_entries(await self.redis.xrevrange(stream, count=500)):
                        data = json.loads(f.get("data") or "{}")
                        if str((data.get("rows") or [{}])[0].get("prompt", "")).startswith(marker):
                            return data["id"]
            except (redis_async.RedisError, OSError, ValueError):
                pass  # Redis is restarting
            await asyncio.sleep(0.05)
        return None
