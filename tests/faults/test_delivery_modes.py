"""Exactly one result in every batching mode: real processes, null engines whose tokens depend
on the batch composition (so a retry that regenerates instead of resuming shows), kills."""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.faults.conftest import (
    KEYS,
    MODEL,
    Cluster,
    audit,
    crash_until_final,
    make_cluster,
    queued,
    record,
    wait_final,
)
from tests.faults.kills import kill_mid_generation
from tests.faults.test_faults import stream_text, submit

MODES = {
    "continuous": "continuous_batching_config: {max_concurrent_batch_size: 16}",
    "dynamic": "dynamic_batching_config: {max_batch_delay_ms: 20, batch_size_target: 4, batch_size_limit: 8}",
    "single": "batch_config: single",
}


def models_yaml(mode: str) -> str:
    return f"models:\n  - name: {MODEL}\n    {MODES[mode]}\n"


def finals_agree_with_streams(c: Cluster, rids: list[str], streamed: dict[str, str]) -> None:
    r = c.sync()
    for rid in rids:
        result = json.loads(r.hget(KEYS.status(rid), "result"))
        assert result["status"] == "done", result
        text = result["output"]["text"]
        assert streamed[rid] == text, f"{rid}: streamed {streamed[rid]!r}, final {text!r}"
        # every token index once per attempt-chain: the reply stream's deltas tile the output
        covered = []
        for _, f in r.xrange(KEYS.reply(rid)):
            if f.get("kind") == "delta":
                ev = json.loads(f["data"])
                covered.extend(range(ev["i"], ev["i"] + len(ev["token_ids"])))
        assert covered == list(range(result["output"]["num_output_tokens"])), covered


@pytest.mark.parametrize("mode", list(MODES))
def test_sigkill_mid_generation_in_every_mode(tmp_path: Path, mode: str) -> None:
    composition = {"SLUICE_NULL_COMPOSITION": "1"}
    with make_cluster(tmp_path, models_yaml(mode), **composition) as c:
        c.start_worker("a")
        c.start_worker("b")
        c.wait_workers(2)
        rids, _ = submit(c, 12, max_tokens=40)
        streamed: dict[str, str] = {}
        readers = [threading.Thread(target=stream_text, args=(c.url, rid, streamed)) for rid in rids]
        for t in readers:
            t.start()
        r = c.sync()
        held = kill_mid_generation(c, "a", rids)  # it held these mid-way, however loaded the machine
        killed_at = time.monotonic()
        wait_final(c, rids, timeout_s=120)
        recovery = time.monotonic() - killed_at
        for t in readers:
            t.join(60)
        figures = audit(c, rids)
        record(f"SIGKILL a worker mid-generation ({mode})", 12, len(rids), figures, recovery)
        assert figures == {"completed": 12, "duplicated": 0, "lost": 0}
        finals_agree_with_streams(c, rids, streamed)
        resumed = {rid: json.loads(r.hget(KEYS.status(rid), "result"))["attempt"] for rid in held}
        assert set(resumed.values()) == {2}, f"not all that a held mid-way were taken over: {resumed}"


def test_a_poison_request_takes_no_neighbour_with_it(tmp_path: Path) -> None:
    """The poison request crashes its worker with 8 healthy requests beside it; they are
    redelivered with it and retried together (a second crash), then split in halves
    until the poison runs in a group of one; they finish, and only it is charged."""
    crash = {"SLUICE_NULL_CRASH_ON": "POISON", "SLUICE_MAX_DELIVERIES": "3"}
    with make_cluster(tmp_path, models_yaml("continuous"), **crash) as c:
        c.start_worker("a")
        c.wait_workers(1)
        c.signal("a", signal.SIGSTOP)  # hold the queue so that all nine start together
        good, _ = submit(c, 8, max_tokens=20)
        (poison,), _ = submit(c, 1, prompt="POISON", max_tokens=20)
        streamed: dict[str, str] = {}
        readers = [threading.Thread(target=stream_text, args=(c.url, rid, streamed)) for rid in good]
        for t in readers:
            t.start()
        c.signal("a", signal.SIGCONT)
        r = c.sync()
        started = time.monotonic()
        crashes = crash_until_final(c, poison)
        wait_final(c, good, timeout_s=60)
        for t in readers:
            t.join(60)
        figures = audit(c, good)
        record("poison beside 8 healthy requests", 9, 9, figures, time.monotonic() - started)
        assert figures == {"completed": 8, "duplicated": 0, "lost": 0}
        finals_agree_with_streams(c, good, streamed)
        # fresh, retried together, about log2(9) halvings, then max_deliveries - 1 runs in a group of one
        assert 4 <= crashes <= 2 + math.ceil(math.log2(9)) + 2, crashes
        (letter,) = r.xrange(KEYS.dead_letters)
        assert letter[1]["id"] == poison


def test_kill_9_redis_in_strict_durability_loses_no_acknowledged_request(tmp_path: Path) -> None:
    """appendfsync always: a 202 means the entry is on disk; kill -9 right after the last one."""
    with make_cluster(tmp_path, strict=True) as c:
        c.start_worker("a")
        c.wait_workers(1)
        c.signal("a", signal.SIGSTOP)  # hold the queue
        rids, _ = submit(c, 50, max_tokens=5)
        down = c.restart_redis()  # no pause: the everysec window would lose the last second
        restarted = time.monotonic()
        assert queued(c.sync(), KEYS.requests) == 50
        c.signal("a", signal.SIGCONT)
        wait_final(c, rids, timeout_s=60)
        figures = audit(c, rids)
        record("kill -9 Redis at once, strict durability", 50, 50, figures, down + time.monotonic() - restarted)
        assert figures == {"completed": 50, "duplicated": 0, "lost": 0}


def test_a_worker_started_while_redis_is_down_waits_for_it(cluster: Cluster) -> None:
    cluster.one_server().stop(kill=True)
    worker = cluster.start_worker("a")
    time.sleep(3)  # longer than the client's own reconnect retries
    assert worker.poll() is None, "the worker gave up on Redis"
    cluster.one_server().start()
    cluster.wait_workers(1)
    rids, _ = submit(cluster, 3, max_tokens=3)
    wait_final(cluster, rids, timeout_s=30)
    assert audit(cluster, rids) == {"completed": 3, "duplicated": 0, "lost": 0}
