"""The faults of `sluice bench chaos`: a thread that SIGKILLs workers, apis and Redis and
starts them again (bench/chaos.py's ChaosStack runs them)."""

from __future__ import annotations

import random
import threading
import time
from typing import TYPE_CHECKING

import httpx
import redis as redis_sync

if TYPE_CHECKING:
    from sluice.bench.chaos import ChaosStack

WORKER_TTL_S = 3.0


class Chaos(threading.Thread):
    """Every `worker_every` s (jittered) SIGKILL a random worker: half restart at once under a
    new name, half under their own name once its lock has expired (to get their pending entries
    back). Every `api_every` s an api, every `redis_every` s (if set) Redis, every `webhooks_every`
    s (if set) the webhook sender.

    A worker or api kill waits until the system is back from the last one: every model has a live
    worker (an api's /readyz), every api answers (/healthz). On a loaded machine, where a process
    takes longer to start than the time between kills, the kills would otherwise leave no api up
    and no worker live most of the time, and the load would make no progress."""

    def __init__(self, stack: ChaosStack, rng: random.Random, calm_at: float, worker_every: float,
                 api_every: float, redis_every: float | None, webhooks_every: float | None = None):
        super().__init__(daemon=True, name="chaos")
        self.stack, self.rng, self.calm_at = stack, rng, calm_at
        self.every = {"worker": worker_every, "api": api_every, "redis": redis_every,
                      "webhooks": webhooks_every}
        self.kills = {"workers": 0, "apis": 0, "redis": 0, "webhooks": 0}
        self.done = threading.Event()
        self.pending: list[tuple[float, str]] = []  # (monotonic time, worker slot) restarts due
        self.killed_pids: set[int] = set()
        self.log: list[str] = []  # what was killed when (wall clock, to match stream entry ids)
        # Default durability's window (single Redis): kills that found a background AOF fsync
        # running, and the AOF writes Redis had postponed past 2 s before each kill (INFO).
        self.aof = {"kills_in_fsync": 0, "delayed_fsync": 0}

    def _note(self, what: str) -> None:
        self.log.append(f"{time.time() * 1000:.0f} {what}")

    def run(self) -> None:
        now = time.monotonic()
        due = {kind: now + self._jitter(every) for kind, every in self.every.items() if every}
        while not self.done.wait(0.1):  # after calm_at: no more kills, everyone back for the drain
            now = time.monotonic()
            for t, slot in [p for p in self.pending if p[0] <= now or now >= self.calm_at]:
                self.pending.remove((t, slot))
                self.stack.start_worker(slot)
            self.stack.check_exits(self.killed_pids)
            for kind, at in due.items():
                if at <= now < self.calm_at and self._recovered(kind):
                    getattr(self, f"_kill_{kind}")()
                    due[kind] = time.monotonic() + self._jitter(self.every[kind])

    def _recovered(self, kind: str) -> bool:
        """Back from the last kill: for a worker kill, every model has a live worker (/readyz of an
        api); for an api kill, every api answers (/healthz). A Redis kill waits for itself."""
        if kind == "worker":
            return any(_answers(url, "readyz") for url in self.stack.urls)
        return kind != "api" or all(_answers(url, "healthz") for url in self.stack.urls)

    def _jitter(self, every: float | None) -> float:
        return (every or 0) * self.rng.uniform(0.6, 1.4)

    def _kill_worker(self) -> None:
        waiting = {slot for _, slot in self.pending}
        slot = self.rng.choice([s for s in self.stack.slots if s not in waiting])
        proc = self.stack.workers[slot]
        self.killed_pids.add(proc.pid)
        self.stack.kill(proc)
        self.kills["workers"] += 1
        self._note(f"killed worker {self.stack.names[slot]}")
        if self.rng.random() < 0.5:
            self.stack.start_worker(slot, new_name=True)
        else:
            self.pending.append((time.monotonic() + WORKER_TTL_S + 0.5, slot))

    def _kill_api(self) -> None:
        i = self.rng.randrange(len(self.stack.apis))
        self.killed_pids.add(self.stack.apis[i].pid)
        self.stack.kill(self.stack.apis[i])
        self.kills["apis"] += 1
        self._note(f"killed api{i}")
        time.sleep(1.0)
        self.stack.start_api(i)

    def _kill_webhooks(self) -> None:
        """SIGKILL the webhook sender mid-delivery and start a new one (a new consumer name: what
        the killed one held comes back by lease)."""
        proc = self.stack.local.webhooks
        assert proc is not None
        self.killed_pids.add(proc.pid)
        self.stack.kill(proc)
        self.kills["webhooks"] += 1
        self._note("killed the webhook sender")
        self.stack.start_webhooks()

    def _kill_redis(self) -> None:
        self._sample_aof()
        self._note("killing redis")
        self.stack.restart_redis()
        self.kills["redis"] += 1
        self._note("redis restarted")

    def _sample_aof(self) -> None:
        """INFO persistence just before a single Redis is killed. In everysec, Redis postpones
        the write() of its AOF buffer while a background fsync runs (up to 2 s, then it writes
        and counts aof_delayed_fsync) but still replies: a kill -9 then loses writes it
        acknowledged. A kill that found an fsync running may have landed in that window."""
        if self.stack.cluster is not None or self.stack.strict:
            return
        try:
            info = redis_sync.Redis.from_url(self.stack.redis_url, socket_timeout=2).info("persistence")
        except redis_sync.RedisError:
            return
        self.aof["kills_in_fsync"] += bool(info.get("aof_pending_bio_fsync"))
        self.aof["delayed_fsync"] += int(info.get("aof_delayed_fsync", 0))


def _answers(url: str, probe: str) -> bool:
    try:
        return httpx.get(f"{url}/{probe}", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
