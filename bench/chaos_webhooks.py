"""Webhooks in `sluice bench chaos`: a receiver on loopback that verifies every POST's signature
with `standardwebhooks` and answers 500 to a random third of first attempts, the endpoint that
points at it, and the audit at the end: every final of an accepted request has its event received
at least once, no event names a request that was not final when it arrived, duplicates share
their `webhook-id` (and body), no signature fails (docs/webhooks.md). With tenants (bench/
chaos_tenants.py) each tenant's key has its own endpoint, `/hooks/<tenant>`, of its own secret: a
POST is verified with the secret of the endpoint it was sent to, and an event of another tenant's
request at an endpoint is a broken promise."""

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
from sluice.bench.chaos_tenants import Tenancy
from sluice.broker.keys import ModelKeys
from sluice.broker.plumbing.decoded import maybe_text
from sluice.broker.plumbing.urls import sync_connect
from sluice.broker.webhooks.outbox import DUE, GROUP, outbox
from sluice.protocol.openai_responses import request_id, response_id
from sluice.protocol.webhooks import event_type


@dataclass
class Post:
    webhook_id: str
    body: str
    event: dict
    state_then: str | None  # the request's state when the POST arrived (None: Redis did not answer)
    endpoint: str = ""  # the tenant whose endpoint it was sent to ('' without tenants: /hooks)


@dataclass
class HookReceiver:
    """Records every POST; answers 400 to a bad signature, 500 to `fail_share` of first attempts.
    A POST whose body ends before its content-length is no request (its sender was killed between
    writing headers and body): counted in `cut_off`, never verified, never answered. `secret`
    verifies POSTs to `url` (/hooks); `secrets` those to /hooks/<tenant>, per tenant."""

    redis_url: str
    fail_share: float = 1 / 3
    seed: int = 0
    secret: str = ""
    secrets: dict[str, str] = field(default_factory=dict)  # tenant -> the secret of its endpoint
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
                headers = {k.lower(): v for k, v in self.headers.items()}
                self.send_response(receiver.receive(headers, raw.decode(), self.path))
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/hooks"
        threading.Thread(target=self._server.serve_forever, daemon=True, name="hook-receiver").start()

    def url_for(self, tenant: str) -> str:
        return f"{self.url}/{tenant}" if tenant else self.url

    def receive(self, headers: dict[str, str], body: str, path: str = "/hooks") -> int:
        """Verify with the secret of the endpoint at `path` (/hooks or /hooks/<tenant>), record, answer."""
        tenant = path.removeprefix("/hooks").removeprefix("/")
        try:
            secret = self.secrets[tenant] if tenant else self.secret
            event = Webhook(secret).verify(body, headers)
        except (KeyError, WebhookVerificationError) as err:
            with self._lock:
                self.bad_signatures.append(f"{headers.get('webhook-id')} at {path}: "
                                           f"{type(err).__name__} {err}")
            return 400
        post = Post(headers["webhook-id"], body, event, self._state(event), tenant)
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
        status = ModelKeys(data.get("model", "")).status(_request_of(data.get("id", "")))
        try:
            return maybe_text(self._redis.hget(status, "state"))
        except (redis_sync.RedisError, OSError):
            return None

    def register(self, api_url: str, tenancy: Tenancy | None = None, timeout_s: float = 60) -> None:
        """Create the endpoints through the api (an admin route): one at /hooks without tenants,
        else one per tenant at /hooks/<tenant>, owned by its key (created with the admin key)."""
        tenancy = tenancy or Tenancy()
        for tenant in tenancy.names or [""]:
            url = self.url_for(tenant)
            owner = tenancy.owner(tenant) if tenant else None
            secret = self._create(api_url, url, owner, tenancy.admin_headers(), time.monotonic() + timeout_s)
            if tenant:
                self.secrets[tenant] = secret
            else:
                self.secret = secret

    @staticmethod
    def _create(api_url: str, url: str, owner: str | None, headers: dict[str, str], deadline: float) -> str:
        """The secret of a new endpoint at `url`, the only one there."""
        body = {"url": url, "description": "chaos", **({"owner": owner} if owner is not None else {})}
        with httpx.Client(base_url=api_url, headers=headers, timeout=10) as http:
            while True:
                try:
                    # A create that timed out here may have been made there, under a secret never seen:
                    # the receiver's earlier endpoints at `url` go first, so one, of this secret, is left.
                    for e in http.get("/v1/webhooks").raise_for_status().json()["data"]:
                        if e["url"] == url:
                            http.delete(f"/v1/webhooks/{e['id']}").raise_for_status()
                    return str(http.post("/v1/webhooks", json=body).raise_for_status().json()["secret"])
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
    delivery due, no outbox entry unread or unacknowledged); returns the seconds waited and what was
    left then (finals without an event, deliveries due, outbox entries: all 0 unless it timed out)."""
    r, t0 = sync_connect(redis_url), time.monotonic()
    outboxes = {outbox(ModelKeys(t.model)) for t in tracked}
    left = {"finals_without_event": -1, "due": -1, "outbox": -1}
    while time.monotonic() - t0 < timeout_s:
        try:
            finals = _finals(r, tracked)
            got = {p.event["data"].get("id") for p in receiver.posts}
            left = {"finals_without_event": sum(_expected(t, s)[0] not in got for t, s in finals),
                    "due": r.zcard(DUE), "outbox": sum(undelivered(r, o) for o in outboxes)}
            if not any(left.values()):
                break
        except redis_sync.RedisError:
            pass
        time.sleep(0.5)
    return time.monotonic() - t0, left


def undelivered(r: redis_sync.Redis, stream: str) -> int:
    """Outbox entries the senders have not fanned out: unread by their group, or read and not
    acknowledged. Not its length: a sender killed between its XACK and its XDEL of an entry it
    fanned out leaves that entry on the stream, read and acknowledged, for good."""
    group = None
    if r.exists(stream):
        group = next((g for g in r.xinfo_groups(stream) if g["name"] == GROUP), None)
    if group is None:
        return r.xlen(stream)
    unread = r.xrange(stream, f"({group['last-delivered-id']}", "+", count=10_000) or []
    return int(group["pending"]) + len(unread)


def _finals(r: redis_sync.Redis, tracked: list[Tracked]) -> list[tuple[Tracked, str]]:
    out = []
    for t in tracked:
        state = maybe_text(r.hget(ModelKeys(t.model).status(t.rid), "state")) if t.rid else None
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
            types = sorted({p.event["type"] for p in posts})
            broken.append(f"wrong type: {object_id} is {state}, events {types}")
    wrong_endpoint = 0
    for object_id, posts in by_object.items():
        data = posts[0].event["data"]
        status = ModelKeys(data.get("model", "")).status(_request_of(object_id))
        now, tenant = map(maybe_text, r.hmget(status, "state", "tenant"))
        if wrong := sorted({p.endpoint for p in posts if p.endpoint and p.endpoint != tenant}):
            wrong_endpoint += 1  # an event of one tenant's request sent to another's endpoint
            broken.append(f"wrong endpoint: {object_id} of tenant {tenant} posted to the endpoint of {wrong}")
        then = [p.state_then for p in posts if p.state_then is not None]
        if now not in FINAL_STATES or any(s not in FINAL_STATES for s in then):
            broken.append(f"not final: an event for {object_id} while its state was {then or now}")
        if len({p.webhook_id for p in posts}) > 1:
            webhook_ids = sorted({p.webhook_id for p in posts})
            broken.append(f"duplicate with another webhook-id: {object_id} {webhook_ids}")
        if len({p.body for p in posts}) > 1:
            broken.append(f"duplicate with another body: {object_id}")
    broken += [f"bad signature: {b}" for b in receiver.bad_signatures]
    ids = {p.webhook_id for p in receiver.posts}
    figures = {"finals": len(finals), "events": len(ids), "posts": len(receiver.posts),
               "failed_first": receiver.failed_first, "cut_off": receiver.cut_off,
               "posted_again": sum(sum(p.webhook_id == i for p in receiver.posts) > 1 for i in ids),
               "broken": len(broken), "bad_signatures": len(receiver.bad_signatures),
               "wrong_endpoint": wrong_endpoint,
               "by_endpoint": {t: len({p.webhook_id for p in receiver.posts if p.endpoint == t})
                               for t in sorted({p.endpoint for p in receiver.posts})}}
    return {"figures": figures, "broken": broken[:20]}


def table_rows(w: dict) -> list[tuple[str, object]]:
    """The chaos table's webhook lines."""
    return [("webhook sender kills", w["kills"]),
            ("webhooks: finals / events received (posts)", f"{w['finals']} / {w['events']} ({w['posts']})"),
            ("webhooks: first attempts answered 500 / events posted again",
             f"{w['failed_first']} / {w['posted_again']}"),
            ("webhooks: events per endpoint",
             ", ".join(f"{t or '/hooks'} {n}" for t, n in w["by_endpoint"].items())),
            ("webhooks: broken (missing, not final, other id or body, bad signature, wrong endpoint)",
             w["broken"]),
            ("webhooks: seconds to deliver the rest after the drain", f"{w['wait_s']:.1f}")]
