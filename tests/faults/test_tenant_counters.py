"""A tenant's counters survive an api killed with SIGKILL mid-traffic: every admitted request's
token charge is settled once by its final (none is left, none twice), a charge the kill left
behind without its request (charged, never admitted) is bounded and expires, every quota key
expires, and the killed api's open streams leave the tenant's stream count once their leases
expire, so a new api gives the tenant all of its streams again."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import httpx

from sluice.api.auth import digest
from tests.faults.conftest import KEYS, make_cluster, wait_final

KEY = "acme-key"
CALLERS = 4  # threads submitting at the kill: at most this many calls charged and never admitted
STREAMS = 3


def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.yaml"
    path.write_text(json.dumps({
        "tenants": {"acme": {"requests_per_minute": 100_000, "tokens_per_minute": 10_000_000,
                             "max_streams": STREAMS}},
        "keys": [{"key": f"sha256:{digest(KEY)}", "scope": "admin", "tenant": "acme"}]}))
    return path


def test_counters_survive_an_api_sigkill(tmp_path: Path) -> None:
    with make_cluster(tmp_path, SLUICE_KEYS_FILE=str(keys_file(tmp_path))) as c:
        c.start_worker("a")
        headers = {"Authorization": f"Bearer {KEY}"}
        r = c.sync()
        accepted: list[str] = []
        stop = threading.Event()

        def submit() -> None:
            with httpx.Client(base_url=c.url, headers=headers, timeout=10) as client:
                while not stop.is_set():
                    try:
                        got = client.post("/v1/requests", json={"prompt": "a" * 40, "max_tokens": 3})
                    except httpx.HTTPError:
                        return  # the api is gone
                    if got.status_code == 202:
                        accepted.append(got.json()["id"])

        def stream(rid: str) -> None:
            try:
                with httpx.stream("GET", f"{c.url}/v1/requests/{rid}/events", headers=headers, timeout=60) as s:
                    for _ in s.iter_lines():
                        pass
            except httpx.HTTPError:
                pass

        long = [httpx.post(f"{c.url}/v1/requests", headers=headers,
                           json={"prompt": "long", "max_tokens": 3000}).json()["id"] for _ in range(STREAMS)]
        readers = [threading.Thread(target=stream, args=(rid,)) for rid in long]
        callers = [threading.Thread(target=submit) for _ in range(CALLERS)]
        for t in readers + callers:
            t.start()
        streams_key = "sluice:{t:acme}:streams"
        while r.zcard(streams_key) < STREAMS or len(accepted) < 50:
            threading.Event().wait(0.05)
        assert c.api is not None
        c.api.send_signal(signal.SIGKILL)  # mid-traffic: calls under way, streams open
        c.api.wait()
        stop.set()
        for t in callers + readers:
            t.join(60)
        assert r.zcard(streams_key) == STREAMS  # the dead api's leases, not yet expired

        c.start_api()
        c.local.wait_ready(60, probe="healthz")
        with httpx.Client(base_url=c.url, headers=headers, timeout=30) as client:
            for rid in long:
                client.delete(f"/v1/requests/{rid}")
            # the leases expire (SLUICE_LEASE_TIMEOUT_S): then the tenant has all its streams again
            while r.exists(streams_key):
                threading.Event().wait(0.1)
            short = [client.post("/v1/requests", json={"prompt": "x", "max_tokens": 400}).json()["id"]
                     for _ in range(STREAMS)]
            opened = [threading.Thread(target=stream, args=(rid,)) for rid in short]
            for t in opened:
                t.start()
            while r.zcard(streams_key) < STREAMS:
                threading.Event().wait(0.05)
            assert client.get(f"/v1/requests/{short[0]}/events").status_code == 429  # the limit holds
            for rid in short:
                client.delete(f"/v1/requests/{rid}")
            for t in opened:
                t.join(60)

        admitted = [k.rsplit(":", 1)[1] for k in r.scan_iter(KEYS.status("*"))]
        wait_final(c, admitted)
        assert set(accepted) <= set(admitted)
        states = {r.hget(KEYS.status(rid), "state") for rid in admitted}
        assert states <= {"done", "cancelled"}, states
        left = [k.rsplit(":", 1)[1] for k in r.scan_iter(KEYS.charge("*"))]
        assert not set(left) & set(admitted)  # every admitted request's charge settled by its final
        assert len(left) <= CALLERS  # a charge the kill left without its request: one per call under way ...
        assert all(0 < r.ttl(KEYS.charge(rid)) for rid in left)  # ... and it expires
        for bucket in r.scan_iter(f"{KEYS.tag}:quota:*"):
            assert 0 < r.pttl(bucket) <= 60_000, bucket  # a bucket is full again within the minute
