"""The webhook audit of `sluice bench chaos` (bench/chaos_webhooks.py) catches each broken
promise: a final without its event, an event for a request that was not final, a duplicate with
another webhook-id, a bad signature. (tests/faults/test_chaos.py runs it for real.)"""

from __future__ import annotations

import json
import socket
import time

import httpx
from redis.asyncio import Redis

from sluice.bench.chaos_audit import Tracked
from sluice.bench.chaos_webhooks import HookReceiver, audit_webhooks
from sluice.broker.keys import ModelKeys
from sluice.broker.webhooks.endpoints import Endpoint
from sluice.protocol.openai_responses import response_id
from sluice.protocol.webhooks import payload
from sluice.workers.webhooks.post import signed_headers

MODEL = "m"


def post(receiver: HookReceiver, endpoint: Endpoint, event_id: str, family: str, state: str, object_id: str) -> int:
    body = payload(event_id, family, state, object_id, 0, {"model": MODEL})
    headers = signed_headers(endpoint, event_id, body, time.time())
    return httpx.post(receiver.url, content=body, headers=headers, timeout=5).status_code


async def test_each_broken_promise_is_found(redis: Redis, redis_url: str) -> None:
    keys = ModelKeys(MODEL)
    for rid, state in (("req-1", "done"), ("req-2", "done"), ("req-3", "queued"), ("req-4", "failed"),
                       ("req-5", "done")):
        await redis.hset(keys.status(rid), "state", state)
    receiver = HookReceiver(redis_url, fail_share=0)
    endpoint = Endpoint("we_1", receiver.url, [], "", "whsec_" + "QUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFB")
    receiver.secret = endpoint.secret
    try:
        assert post(receiver, endpoint, "msg_1", "request", "done", "req-1") == 200
        assert post(receiver, endpoint, "msg_1", "request", "done", "req-1") == 200  # a duplicate: fine
        # req-2's final has no event; req-3 is not final yet has one
        assert post(receiver, endpoint, "msg_3", "request", "done", "req-3") == 200
        assert post(receiver, endpoint, "msg_4", "request", "failed", "req-4") == 200
        assert post(receiver, endpoint, "msg_4b", "request", "failed", "req-4") == 200  # another webhook-id
        assert post(receiver, endpoint, "msg_5", "response", "done", response_id("req-5")) == 200
        forged = Endpoint("we_1", receiver.url, [], "", "whsec_" + "QkJCQkJCQkJCQkJCQkJCQkJCQkJCQkJC")
        assert post(receiver, forged, "msg_6", "request", "done", "req-1") == 400
    finally:
        receiver.stop()
    tracked = [Tracked(rid, MODEL, "stream", None, 1) for rid in ("req-1", "req-2", "req-3", "req-4")]
    tracked.append(Tracked("req-5", MODEL, "structured", None, 1))
    found = audit_webhooks(redis_url, receiver, tracked)
    assert found["figures"]["finals"] == 4 and found["figures"]["broken"] == 5, json.dumps(found, indent=1)
    lines = found["broken"]
    assert any(b.startswith("missing: no event for req-2") for b in lines)
    assert any(b.startswith("not final: an event for req-3") for b in lines)
    assert any(b.startswith("duplicate with another webhook-id: req-4") for b in lines)
    assert "duplicate with another body: req-4" in lines
    assert any(b.startswith("bad signature: msg_6") for b in lines)


async def test_a_post_cut_off_by_its_sender_is_not_a_bad_signature(redis_url: str) -> None:
    """A sender SIGKILLed between its request's headers and its body (httpcore writes them apart)
    leaves the receiver a content-length it never gets: no request, so neither a post nor a bad
    signature (the delivery is posted again once its lease ends). A whole post still verifies."""
    receiver = HookReceiver(redis_url, fail_share=0)
    endpoint = Endpoint("we_1", receiver.url, [], "", "whsec_" + "QUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFB")
    receiver.secret = endpoint.secret
    body = payload("msg_1", "request", "done", "req-1", 0, {"model": MODEL})
    signed = signed_headers(endpoint, "msg_1", body, time.time())
    head = f"POST /hooks HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in signed.items()) + "\r\n"
    port = int(receiver.url.split(":")[2].split("/")[0])
    try:
        for sent in ("", body[: len(body) // 2]):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall((head + sent).encode())
                s.shutdown(socket.SHUT_WR)  # the sender is gone: the receiver reads to the end of the stream
                while s.recv(4096):  # closed once the handler is done with it
                    pass
        assert receiver.bad_signatures == [] and receiver.posts == [] and receiver.cut_off == 2
        assert post(receiver, endpoint, "msg_1", "request", "done", "req-1") == 200
    finally:
        receiver.stop()
    assert [p.webhook_id for p in receiver.posts] == ["msg_1"] and receiver.bad_signatures == []
