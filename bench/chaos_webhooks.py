"""Webhooks in `sluice bench chaos`: a receiver on loopback that verifies every POST's signature
with `standardwebhooks` and answers 500 to a random third of first attempts, the endpoint that
points at it, and the audit at the end: every final of an accepted request has its event received
at least once, no event names a request that was not final when it arrived, duplicates share
their `webhook-id` (and body), no signature fails (docs/webhooks.md)."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import redis as redis_sync
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from sluice.bench.chaos_audit import FINAL_STATES, Tracked
from sluice.broker.keys import ModelKeys
from sluice.broker.urls import sync_connect
from sluice.broker.webhooks import DUE, outbox
from sluice.protocol.openai_responses import request_id, response_id
from sluice.protocol.webhooks import event_type


@dataclass
class Post:
    webhook_id: str
    body: str
    event: dict
    state_then: str | None  # the request's state when the POST arrived (None: Redis did not answer)


@dataclass
class HookReceiver:
    """Records every POST; answers 400 to a bad signature, 500 to `fail_share` of first attempts.
    A POST whose body ends before its content-length is no request (its sender was killed between
    writing headers and body): counted in `cut_off`, never verified, never answered."""

    redis_url: str
    fail_share: float = 1 / 3
    seed: int = 0
    secret: str = ""
    posts: list[Post] = field(default_factory=list)
    bad_signatures: list[str] = field(default_factory=list)
    failed_first: int = 0
    cut_off: int = 0  # POSTs whose body ended before their content-length (a sender SIGKILLed mid-request)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._rng = random.Random(self.seed)
        self._seen: set[str] = set()
        self._redis = sync_connect(self.redis_url, socket_timeout=2)
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                length = int(self.headers.get("content-length") or 0)
                try:
                    raw = self.rfile.read(length)
                except OSError:
                    raw = b""
                if len(raw) < length:  # its sender died between headers and body: no request, no answer
                    receiver.cut_short()
                    self.close_connection = True
                    return
                self.send_response(receiver.receive({k.lower(): v for k, v in self.headers.items()}, raw.decode()))
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/hooks"
        threading.Thread(target=self._server.serve_forever, daemon=True, name="hook-receiver").start()

    def receive(self, headers: dict[str, str], body: str) -> int:
        try:
            event = Webhook(self.secret).verify(body, headers)
        except WebhookVerificationError as err:
            with self._lock:
                self.bad_signatures.append(f"{headers.get('webhook-id')}: {err}")
            return 400
        post = Post(headers["webhook-id"], body, event, self._state(event))
        with self._lock:
            self.posts.append(post)
            first = post.webhook_id not in self._seen
            self._seen.add(post.webhook_id)
            fail = first and self._rng.random() < self.fail_share
            self.failed_first += fail
        return 500 if fail else 200

    def cut_short(self) -> None:
        with self._lock:
            self.cut_off += 1

    def _state(self, event: dict) -> str | None:
        data = event.get("data") or {}
        try:
            return self._redis.hget(ModelKeys(data.get("model", "")).status(_request_of(data.get("id", ""))), "state")
        except (redis_sync.RedisError, OSError):
            return None

    def register(self, api_url: str, timeout_s: float = 60) -> str:
        """Create the endpoint through the api (admin route; no keys in the chaos stack)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                # A create that timed out here may have been made there, under a secret never
                # seen: the receiver's earlier endpoints go first, so one endpoint, of this secret, is left.
                for e in httpx.get(f"{api_url}/v1/webhooks", timeout=10).raise_for_status().json()["data"]:
                    if e["url"] == self.url:
                        httpx.delete(f"{api_url}/v1/webhooks/{e['id']}", timeout=10).raise_for_status()
                r = httpx.post(f"{api_url}/v1/webhooks", json={"url": self.url, "description": "chaos"}, timeout=10)
                r.raise_for_status()
                self.secret = r.json()["secret"]
                return r.json()["id"]
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _request_of(object_id: str) -> str:
    """The request id behind an event's object id (a response's `resp_...` names its request)."""
    return request_id(object_id) or object_id


def _expected(t: Tracked, state: str) -> tuple[str, str]:
    """(object id, event type) of a tracked request's final."""
    if t.kind == "structured":
        return response_id(t.rid), event_type("response", state)
    return t.rid, event_type("request", state)


def wait_delivered(redis_url: str, receiver: HookReceiver, tracked: list[Tracked],
                   timeout_s: float) -> tuple[float, dict[str, int]]:
    """Until every final among `tracked` has had an event and nothing is left to deliver (no
    delivery due, no outbox entry unread); returns the seconds waited and what was left then
    (finals without an event, deliveries due, outbox entries: all 0 unless it timed out)."""
    r, t0 = sync_connect(redis_url), time.monotonic()
    outboxes = {outbox(ModelKeys(t.model)) for t in tracked}
    left = {"finals_without_event": -1, "due": -1, "outbox": -1}
    while time.monotonic() - t0 < timeout_s:
        try:
            finals = _finals(r, tracked)
            got = {p.event["data"].get("id") for p in receiver.posts}
            left = {"finals_without_event": sum(_expected(t, s)[0] not in got for t, s in finals),
                    "due": r.zcard(DUE), "outbox": sum(r.xlen(o) for o in outboxes)}
            if not any(left.values()):
                break
        except redis_sync.RedisError:
            pass
        time.sleep(0.5)
    return time.monotonic() - t0, left


def _finals(r: redis_sync.Redis, tracked: list[Tracked]) -> list[tuple[Tracked, str]]:
    out = []
    for t in tracked:
        state = r.hget(ModelKeys(t.model).status(t.rid), "state") if t.rid else None
        if state in FINAL_STATES:
            out.append((t, state))
    return out


def audit_webhooks(redis_url: str, receiver: HookReceiver, tracked: list[Tracked]) -> dict:
    """The figures and the broken promises (`webhooks_broken`: one line each, at most 20 kept)."""
    r = sync_connect(redis_url)
    broken: list[str] = []
    by_object: dict[str, list[Post]] = {}
    for p in receiver.posts:
        if p.event.get("type") != "webhook.test":
            by_object.setdefault(p.event["data"]["id"], []).append(p)
    finals = _finals(r, tracked)
    for t, state in finals:
        object_id, kind = _expected(t, state)
        posts = by_object.get(object_id)
        if not posts:
            broken.append(f"missing: no event for {object_id} ({state})")
        elif {p.event["type"] for p in posts} != {kind}:
            broken.append(f"wrong type: {object_id} is {state}, events {sorted({p.event['type'] for p in posts})}")
    for object_id, posts in by_object.items():
        data = posts[0].event["data"]
        now = r.hget(ModelKeys(data.get("model", "")).status(_request_of(object_id)), "state")
        then = [p.state_then for p in posts if p.state_then is not None]
        if now not in FINAL_STATES or any(s not in FINAL_STATES for s in then):
            broken.append(f"not final: an event for {object_id} while its state was {then or now}")
        if len({p.webhook_id for p in posts}) > 1:
            broken.append(f"duplicate with another webhook-id: {object_id} {sorted({p.webhook_id for p in posts})}")
        if len({p.body for p in posts}) > 1:
            broken.append(f"duplicate with another body: {object_id}")
    broken += [f"bad signature: {b}" for b in receiver.bad_signatures]
    ids = {p.webhook_id for p in receiver.posts}
    figures = {"finals": len(finals), "events": len(ids), "posts": len(receiver.posts),
               "failed_first": receiver.failed_first, "cut_off": receiver.cut_off,
               "posted_again": sum(sum(p.webhook_id == i for p in receiver.posts) > 1 for i in ids),
               "broken": len(broken), "bad_signatures": len(receiver.bad_signatures)}
    return {"figures": figures, "broken": broken[:20]}


def table_rows(w: dict) -> list[tuple[str, object]]:
    """The chaos table's webhook lines."""
    return [("webhook sender kills", w["kills"]),
            ("webhooks: finals / events received (posts)", f"{w['finals']} / {w['events']} ({w['posts']})"),
            ("webhooks: first attempts answered 500 / events posted again",
             f"{w['failed_first']} / {w['posted_again']}"),
            ("webhooks: broken (missing, not final, other id or body, bad signature)", w["broken"]),
            ("webhooks: seconds to deliver the rest after the drain", f"{w['wait_s']:.1f}")]
