"""SIGKILL a worker mid-generation as a condition, not a timing: the kill lands while the worker
holds a request it has streamed tokens of and not finished, however loaded the machine is."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import redis as redis_sync

from tests.faults.conftest import FINALS, KEYS, Cluster


def _stopped(pid: int) -> bool:
    """Every thread of `pid` is stopped (SIGSTOP takes effect on each thread's next return to
    user space, not when kill() returns): from then on it sends nothing."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            states.append(task.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0])
    return bool(states) and all(s in "tT" for s in states)


def _tcp_links(pid: int) -> set[tuple[int, int]]:
    """The TCP connections `pid` holds, as (its local port, the peer's port) (read while it lives)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            link = os.readlink(fd)
            if link.startswith("socket:["):
                inodes.add(link[len("socket:["):-1])
    links = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[9] in inodes:
                    links.add((int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16)))
    return links


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _still_connected(r: redis_sync.Redis, links: set[tuple[int, int]]) -> bool:
    """Whether a Redis node still holds one of these connections: the same client port to the
    same server port (a port alone is not enough: once the dead worker's port is free, another
    process's new connection to another node of a cluster can get it). A node drops a dead
    client's connection once it has read it to its end: every command sent before has run."""
    nodes = r.get_nodes() if isinstance(r, redis_sync.RedisCluster) else [None]
    for node in nodes:
        clients = r.client_list(target_nodes=node) if node is not None else r.client_list()
        if any((_port(c["addr"]), _port(c["laddr"])) in links for c in clients):
            return True
    return False


def _generating(r: redis_sync.Redis, worker: str, rids: list[str]) -> dict[str, str]:
    """The requests `worker` runs and has streamed tokens of, with their attempt (one round
    trip per node)."""
    with r.pipeline(transaction=False) as pipe:
        for rid in rids:
            pipe.hmget(KEYS.status(rid), "worker", "state", "attempt")
            pipe.xlen(KEYS.reply(rid))
        got = pipe.execute()
    return {rid: status[2] for rid, status, replied in zip(rids, got[::2], got[1::2])
            if status[:2] == [worker, "running"] and replied}


def _unfinished(r: redis_sync.Redis, attempts: dict[str, str]) -> list[str]:
    """Those of the requests whose attempt named did not finish (another may have since)."""
    unfinished = []
    for rid, attempt in attempts.items():
        state, result = r.hmget(KEYS.status(rid), "state", "result")
        if state not in FINALS or str(json.loads(result).get("attempt")) != attempt:
            unfinished.append(rid)
    return unfinished


def kill_mid_generation(c: Cluster, worker: str, rids: list[str], timeout_s: float = 60) -> list[str]:
    """SIGKILL `worker` while it runs one of `rids` mid-way; returns the requests it held
    running and unfinished at the kill (exactly: read once Redis has run all that the dead
    worker sent).

    Each look: the worker is stopped (SIGSTOP, and seen stopped), Redis is read twice (the first
    round trip lets it run what the worker sent just before it stopped); with a request running
    on it that shows tokens, it is killed; else it is resumed and looked at again."""
    r = c.sync()
    proc = c.workers[worker]
    deadline = time.monotonic() + timeout_s
    while True:
        assert time.monotonic() < deadline, f"worker {worker} generated nothing to kill it in: proves nothing"
        if not _generating(r, worker, rids):  # cheap look first: stop it only when it is worth a look
            time.sleep(0.02)
            continue
        proc.send_signal(signal.SIGSTOP)
        while not _stopped(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, f"worker {worker} did not stop"
            time.sleep(0.001)
        _generating(r, worker, rids)
        if candidates := _generating(r, worker, rids):
            break
        proc.send_signal(signal.SIGCONT)
    links = _tcp_links(proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    while _still_connected(r, links):
        assert time.monotonic() < deadline + 30, f"Redis still holds a connection of the killed worker {worker}"
        time.sleep(0.02)
    # What the worker sent before it stopped has run now: a candidate it finished shows that
    # attempt's final; any other it held unfinished (another worker may have taken it over since).
    held = _unfinished(r, candidates)
    assert held, f"worker {worker} held nothing running at the kill: the test proves nothing"
    return held
