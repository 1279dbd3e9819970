"""The load and the audit of `sluice bench chaos`.

Clients submit with an Idempotency-Key (retried on either api until a 202 or a refusal),
then follow their request to its final: SSE readers reconnect with Last-Event-ID (through
the other api when theirs died), pollers long-poll the status. The audit then reads every
accepted request's status hash and reply stream straight from Redis.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from dataclasses import dataclass, field

import httpx
import redis as redis_sync

from sluice.broker.keys import ModelKeys, idempotency
from sluice.broker.urls import sync_connect

FINAL_STATES = ("done", "failed", "expired", "cancelled")
SUBMIT_TIMEOUT_S = 60.0  # a submit still unanswered after this long is given up (never counted as accepted)


@dataclass
class Tracked:
    """One accepted request, as its client saw it."""

    rid: str
    model: str
    mode: str  # "stream" | "poll"
    idem_key: str
    submit_tries: int
    deltas: list[tuple[int, str]] = field(default_factory=list)  # (index, text) in the order received
    final: dict | None = None  # the final view the client got (SSE done/error, or a final poll)
    reconnects: int = 0
    dropped: bool = False  # the client closed its stream on purpose once, then resumed


@dataclass
class LoadFigures:
    tracked: list[Tracked] = field(default_factory=list)
    queue_full: int = 0  # 503 overloaded: refused, not accepted
    submit_gave_up: int = 0
    submit_retries: int = 0
    client_errors: list[str] = field(default_factory=list)


class Load:
    def __init__(self, urls: list[str], models: list[str], *, clients: int, seed: int, max_tokens: tuple[int, int],
                 hangups: float):
        self.urls, self.models, self.clients, self.hangups = urls, models, clients, hangups
        self.rng = random.Random(seed)
        self.max_tokens = max_tokens
        self.figures = LoadFigures()

    async def run(self, seconds: float, follow_until: float) -> LoadFigures:
        """Keep `clients` requests in flight for `seconds`; every client then follows its last
        request until it is final or until the monotonic time `follow_until`."""
        timeout = httpx.Timeout(30, connect=3)
        limits = httpx.Limits(max_connections=4 * self.clients, max_keepalive_connections=2 * self.clients)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
            stop = time.monotonic() + seconds
            await asyncio.gather(*(self._client(http, c, stop, follow_until) for c in range(self.clients)))
        return self.figures

    async def _client(self, http: httpx.AsyncClient, c: int, stop: float, follow_until: float) -> None:
        n = 0
        while time.monotonic() < stop:
            n += 1
            model = self.rng.choice(self.models)
            api = self.rng.randrange(len(self.urls))
            body = {"model": model, "prompt": f"chaos client {c} request {n}", "temperature": 0.0,
                    "max_tokens": self.rng.randint(*self.max_tokens)}
            tracked = await self._submit(http, api, body, "stream" if self.rng.random() < 0.6 else "poll")
            if tracked is None:
                continue
            self.figures.tracked.append(tracked)
            try:
                if tracked.mode == "stream":
                    await self._stream(http, tracked, api, follow_until)
                else:
                    await self._poll(http, tracked, api, follow_until)
            except Exception as err:  # a bench bug must not stop the load; it is reported
                self.figures.client_errors.append(f"{tracked.rid}: {type(err).__name__}: {err}")

    async def _submit(self, http: httpx.AsyncClient, api: int, body: dict, mode: str) -> Tracked | None:
        key = f"chaos-{uuid.uuid4().hex}"
        give_up = time.monotonic() + SUBMIT_TIMEOUT_S
        tries = 0
        while time.monotonic() < give_up:
            tries += 1
            url = self.urls[(api + tries - 1) % len(self.urls)]  # a retry goes to the other api
            try:
                r = await http.post(f"{url}/v1/requests", json=body, headers={"Idempotency-Key": key}, timeout=10)
            except httpx.TransportError:
                r = None
            if r is not None and r.status_code == 202:
                self.figures.submit_retries += tries - 1
                return Tracked(r.json()["id"], r.json()["model"], mode, key, tries)
            if r is not None and r.status_code == 503 and "overloaded" in r.text:
                self.figures.queue_full += 1  # refused for good: nothing was enqueued under this key
                await asyncio.sleep(0.5)
                return None
            if r is not None and r.status_code < 500:
                self.figures.client_errors.append(f"submit {r.status_code}: {r.text[:200]}")
                return None
            await asyncio.sleep(0.2)  # the api or Redis is down: the same key again, on the other api
        self.figures.submit_gave_up += 1
        return None

    async def _stream(self, http: httpx.AsyncClient, t: Tracked, api: int, follow_until: float) -> None:
        """Follow the SSE stream to its final; a share of the readers also hang up once after a
        few deltas (as a browser or a phone changing networks does) and resume with Last-Event-ID."""
        last_id: str | None = None
        drop_after = self.rng.randint(1, 6) if self.rng.random() < self.hangups else None
        while time.monotonic() < follow_until:
            url = self.urls[(api + t.reconnects) % len(self.urls)]
            headers = {"Last-Event-ID": last_id} if last_id else {}
            try:
                async with http.stream("GET", f"{url}/v1/requests/{t.rid}/events", headers=headers) as r:
                    if r.status_code == 200:
                        event: dict[str, str] = {}
                        async for line in r.aiter_lines():
                            if line:
                                name, _, value = line.partition(":")
                                event[name] = value[1:] if value.startswith(" ") else value
                                continue
                            if event.get("id"):
                                last_id = event["id"]
                            data = json.loads(event["data"]) if "data" in event else None
                            if event.get("event") == "delta" and data is not None:
                                t.deltas.append((data["index"], data["text"]))
                                if drop_after is not None and len(t.deltas) >= drop_after:
                                    drop_after, t.dropped = None, True
                                    break
                            elif event.get("event") in ("done", "error") and data is not None:
                                t.final = data
                                return
                            event = {}
            except httpx.TransportError:
                pass
            t.reconnects += 1  # the stream broke or ended without a final: resume from the last event
            await asyncio.sleep(0.2)

    async def _poll(self, http: httpx.AsyncClient, t: Tracked, api: int, follow_until: float) -> None:
        while time.monotonic() < follow_until:
            url = self.urls[(api + t.reconnects) % len(self.urls)]
            try:
                r = await http.get(f"{url}/v1/requests/{t.rid}", params={"wait": 5}, timeout=15)
                if r.status_code == 200 and r.json()["status"] in FINAL_STATES:
                    t.final = r.json()
                    return
                if r.status_code == 200:
                    continue
            except httpx.TransportError:
                pass
            t.reconnects += 1
            await asyncio.sleep(0.2)


def replay(deltas: list[dict]) -> str:
    """The text a reader following the reply stream from its start receives (the api's rule:
    a delta starting below the next undelivered index of its row is skipped whole)."""
    seen: dict[int, int] = {}
    out = []
    for d in deltas:
        if d.get("row", 0) != 0 or d["i"] < seen.get(0, 0):
            continue
        seen[0] = d["i"] + len(d["token_ids"])
        out.append(d["text"])
    return "".join(out)


def overlaps(deltas: list[dict]) -> list[str]:
    """Token indices covered twice by deltas of one attempt (one row), with the two entry ids."""
    covered: dict[tuple[int, int], dict[int, str]] = {}
    twice = []
    for d in deltas:
        cells = covered.setdefault((d.get("attempt", 1), d.get("row", 0)), {})
        for i in range(d["i"], d["i"] + len(d["token_ids"])):
            if i in cells:
                twice.append(f"attempt {d.get('attempt', 1)} row {d.get('row', 0)} index {i} "
                             f"(entries {cells[i]} and {d.get('_id')})")
            cells[i] = d.get("_id", "")
    return twice


def gaps(deltas: list[dict]) -> list[str]:
    """Token indices skipped inside one attempt's deltas (a write of deltas that was lost);
    an attempt may start past 0 (it resumes), but then goes on without holes."""
    end: dict[tuple[int, int], int] = {}
    holes = []
    for d in deltas:
        key = (d.get("attempt", 1), d.get("row", 0))
        if key in end and d["i"] > end[key]:
            holes.append(f"attempt {key[0]} row {key[1]} indices {end[key]}-{d['i'] - 1} (before entry {d.get('_id')})")
        end[key] = max(end.get(key, 0), d["i"] + len(d["token_ids"]))
    return holes


def runs(deltas: list[dict]) -> list[str]:
    """The reply stream's deltas in order, contiguous ones of one attempt and row joined:
    "a1 r0 i0-41" is attempt 1, row 0, token indices 0 to 41."""
    out: list[list] = []  # [attempt, row, first, end]
    for d in deltas:
        a, r, i, end = d.get("attempt", 1), d.get("row", 0), d["i"], d["i"] + len(d["token_ids"])
        if out and out[-1][:2] == [a, r] and out[-1][3] == i:
            out[-1][3] = end
        else:
            out.append([a, r, i, end])
    return [f"a{a} r{r} i{i}-{end - 1}" for a, r, i, end in out]


def audit_one(r: redis_sync.Redis, t: Tracked) -> dict:
    """What Redis holds for one accepted request, and which invariants it breaks."""
    keys = ModelKeys(t.model)
    status = r.hgetall(keys.status(t.rid))
    entries = r.xrange(keys.reply(t.rid))
    deltas = [{**json.loads(f["data"]), "_id": eid} for eid, f in entries if f.get("kind") == "delta"]
    finals = [json.loads(f["data"]) for _, f in entries if f.get("kind") == "final"]
    final_text = ((finals[0].get("output") or {}).get("text")) if finals else None
    row = {"rid": t.rid, "model": t.model, "mode": t.mode, "state": status.get("state"),
           "finals": [f"{f['status']}@attempt{f.get('attempt')}: {f.get('error') or ''}" for f in finals],
           "deltas": runs(deltas),
           "status_attempt": status.get("attempt"), "worker": status.get("worker"),
           "submit_tries": t.submit_tries, "reconnects": t.reconnects, "dropped": t.dropped, "broken": []}
    if not finals:
        row["broken"].append("lost: no final event")
        entry = status.get("entry")
        row["stream_entry_present"] = bool(entry and r.xrange(status.get("stream", keys.requests), entry, entry))
        row["idempotency_bound"] = r.get(idempotency(f"anonymous:{t.idem_key}"))
        row["in_dead_letters"] = any(f.get("id") == t.rid for _, f in r.xrange(keys.dead_letters))
    if len(finals) > 1:
        row["broken"].append(f"duplicated: {len(finals)} final events")
    if finals and status.get("state") != finals[0]["status"]:
        row["broken"].append(f"status {status.get('state')} != final event {finals[0]['status']}")
    if twice := overlaps(deltas):
        row["broken"].append(f"duplicated: {len(twice)} token indices delivered twice, e.g. {twice[0]}")
    if holes := gaps(deltas):
        row["gaps"] = holes  # not broken by itself: a retry may have resumed from the hole
    if final_text is not None and (text := replay(deltas)) != final_text:
        row["broken"].append(f"replayed deltas != final text: {text[-60:]!r} vs {final_text[-60:]!r}")
    client_text = ((t.final or {}).get("output") or {}).get("text")
    if t.mode == "stream" and client_text is not None:
        streamed = "".join(text for _, text in t.deltas)
        if streamed != client_text:
            row["broken"].append(f"streamed text != final text: {streamed[-60:]!r} vs {client_text[-60:]!r}")
    if finals and t.final is None:
        row["reader_unfinished"] = True  # the client gave up: not a lost request
    return row


def audit(redis_url: str, tracked: list[Tracked]) -> dict:
    r = sync_connect(redis_url)
    rows = [audit_one(r, t) for t in tracked]
    figures = {"accepted": len(tracked), "done": 0, "failed": 0, "expired": 0, "cancelled": 0,
               "lost": 0, "duplicated": 0, "text_mismatch": 0, "retried": 0, "readers_unfinished": 0,
               "readers_dropped": sum(t.dropped for t in tracked)}
    for row in rows:
        state = row["finals"][0].split("@")[0] if row["finals"] else None
        if state in FINAL_STATES:
            figures[state] += 1
        figures["lost"] += any(b.startswith("lost") for b in row["broken"])
        figures["duplicated"] += any(b.startswith("duplicated") or "text" in b for b in row["broken"])
        figures["text_mismatch"] += any("text" in b for b in row["broken"])
        figures["retried"] += int(row["status_attempt"] or 1) > 1
        figures["readers_unfinished"] += bool(row.get("reader_unfinished"))
    figures["dead_letters"] = sum(r.xlen(ModelKeys(m).dead_letters) for m in {t.model for t in tracked})
    figures["token_gaps"] = sum(bool(row.get("gaps")) for row in rows)
    return {"figures": figures, "broken": [row for row in rows if row["broken"]],
            "gaps": [row for row in rows if row.get("gaps") and not row["broken"]],
            "not_done": [row for row in rows if not row["broken"] and row["state"] != "done"]}
