"""`sluice bench chaos`: steady load on two apis and two models while workers, apis and Redis
are killed with SIGKILL and restarted; then an audit of every accepted request and of every
reader's text (bench/chaos_load.py says what the clients do, bench/chaos_audit.py what is checked).

The stack is private: one redis-server (or with --redis-cluster a local Redis Cluster of
three primaries and three replicas), a continuous and a dynamic model, two api processes and
null-engine workers that stream tokens slowly, so kills land mid-generation. Leases are short
so that reclaims happen within the run. A single Redis is killed with -9 and restarted from
its AOF, in the durability asked for. Default (`appendfsync everysec`) can lose acknowledged
writes even when only the process dies: while a background fsync runs, Redis 7 postpones the
write() of its AOF buffer (for up to 2 s, then logs "Asynchronous AOF fsync is taking too long")
yet still replies, so a kill in that window loses what it acknowledged meanwhile; the table
counts the kills that found an fsync running and the postponements. Strict (`appendfsync always`)
writes and fsyncs before every reply and has no such window. On a cluster, a Redis kill is a
SIGKILL of the primary that holds a model's slot: its replica takes over, and the killed node
comes back as a replica.
With --tenants N (3 by default) the stack runs with a keys file and the clients send as N tenants
of unequal weights, each with its own key and webhook endpoint (bench/chaos_tenants.py).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import subprocess
import tempfile
import time
from pathlib import Path

import typer
from rich.console import Console

from sluice.bench.chaos_audit import audit, broken, table
from sluice.bench.chaos_faults import WORKER_TTL_S, Chaos
from sluice.bench.chaos_load import Load
from sluice.bench.chaos_tenants import Tenancy
from sluice.bench.chaos_webhooks import HookReceiver, audit_webhooks, table_rows, wait_delivered
from sluice.broker.keys import ModelKeys
from sluice.supervisor.processes import free_port, wait_ready
from sluice.supervisor.stack import LocalStack
from sluice.supervisor.topologies import LocalCluster

MODELS = """models:
  - name: chaos-cont
    continuous_batching_config: {max_concurrent_batch_size: 16}
  - name: chaos-dyn
    dynamic_batching_config: {max_batch_delay_ms: 20, batch_size_target: 4, batch_size_limit: 8}
"""
MODEL_NAMES = ["chaos-cont", "chaos-dyn"]


class ChaosStack:
    """Redis, two apis, `workers_per_model` workers per model and (`webhooks`) a webhook sender;
    every process can be killed and started again. Process output goes to `logs/` (one file per
    api or worker slot, `webhooks.log`). With `tenancy`'s tenants, every process reads its keys file."""

    def __init__(self, tmp: Path, logs: Path, *, workers_per_model: int, token_delay_s: float, strict: bool,
                 cluster: bool = False, webhooks: bool = False, tenancy: Tenancy | None = None):
        self.logs, self.strict, self.tenancy = logs, strict, tenancy or Tenancy()
        keys_file = self.tenancy.write(tmp / "keys.yaml")
        self.rng = random.Random(1)
        self.cluster = LocalCluster(tmp / "cluster").start() if cluster else None
        env = {"SLUICE_LEASE_TIMEOUT_S": "2",
               "SLUICE_WORKER_TTL_S": str(WORKER_TTL_S), "SLUICE_HEARTBEAT_INTERVAL_S": "0.3",
               "SLUICE_CANCEL_POLL_S": "0.1", "SLUICE_SHUTDOWN_TIMEOUT_S": "5", "SLUICE_REPLY_TTL_S": "3600",
               "SLUICE_NULL_TOKEN_DELAY_S": str(token_delay_s), "SLUICE_NULL_COMPOSITION": "1",
               # Ten deliveries: a request killed three times by bad luck is no finding.
               "SLUICE_LOG_LEVEL": "WARNING", "SLUICE_MAX_DELIVERIES": "10",
               # The receiver is on loopback; retries and a killed sender's leases come round fast.
               "SLUICE_WEBHOOKS_ALLOW_PRIVATE": "1", "SLUICE_WEBHOOKS_RETRY_BASE_S": "0.2",
               "SLUICE_WEBHOOKS_TIMEOUT_S": "2", "SLUICE_WEBHOOKS_LEASE_S": "3",
               **({"SLUICE_DURABILITY": "strict"} if strict and not cluster else {}),
               **({"SLUICE_KEYS_FILE": str(keys_file)} if keys_file else {}),
               # On a cluster: an admission is answered once it is on a replica, so that the
               # replica that takes over has it (no bulk jobs here: their broker is never used).
               **({"SLUICE_REDIS_WAIT_REPLICAS": "1", "SLUICE_JOBS_BROKER_URL": "redis://127.0.0.1:1/0"}
                  if cluster else {})}
        self.local = LocalStack(tmp, MODELS, env=env, strict=strict, output="logs", logs_dir=logs,
                                redis_url=self.cluster.url if self.cluster else None)
        self.redis_url = self.local.start_redis()
        self.ports = [free_port(), free_port()]
        self.apis: dict[int, subprocess.Popen] = {}
        self.workers: dict[str, subprocess.Popen] = {}  # slot -> process
        self.names: dict[str, str] = {}  # slot -> the consumer name it was last started with
        self.slots = [f"{m}-w{k}" for m in MODEL_NAMES for k in range(workers_per_model)]
        self.generation = 0
        self.unexpected_exits: list[str] = []
        self.webhooks = webhooks

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def start_api(self, i: int) -> None:
        self.local.start_api(self.ports[i], log=f"api{i}")
        self.apis[i] = self.local.apis[self.ports[i]]

    def start_worker(self, slot: str, new_name: bool = False) -> None:
        if new_name or slot not in self.names:
            self.generation += 1
            self.names[slot] = f"{slot}-g{self.generation}"
        model = slot.rsplit("-w", 1)[0]
        self.workers[slot] = self.local.start_worker(model, self.names[slot], engine="null", log=slot)

    def start_webhooks(self) -> subprocess.Popen:
        return self.local.start_webhooks()

    def start(self) -> None:
        for slot in self.slots:
            self.start_worker(slot)
        if self.webhooks:
            self.start_webhooks()
        for i in range(len(self.ports)):
            self.start_api(i)
        for url in self.urls:
            # Minutes on a loaded machine: six Python processes start at once.
            wait_ready(url, [*self.apis.values(), *self.workers.values()], timeout_s=300)

    def kill(self, proc: subprocess.Popen) -> None:
        self.local.kill(proc)

    def restart_redis(self) -> None:
        if self.cluster is None:
            self.local.restart_redis(down_s=0.5)
            return
        key = ModelKeys(self.rng.choice(MODEL_NAMES)).requests
        victim = self.cluster.primary_of(key)
        victim.stop(kill=True)
        self.cluster.wait_failover(victim, key)
        victim.start()  # back as a replica of the node that took over

    def aof_postponed_logged(self) -> int:
        """AOF writes postponed past 2 s, as the single Redis logged them (its log survives kills)."""
        log = self.local.data_dir / "redis" / "redis.log"
        if self.cluster is not None or not log.exists():
            return 0
        return log.read_text(errors="replace").count("fsync is taking too long")

    def check_exits(self, expected: set[int]) -> None:
        """Restart a process that died without being killed here (and say so in the report)."""
        for i, p in list(self.apis.items()):
            if p.poll() is not None and p.pid not in expected:
                self.unexpected_exits.append(f"api{i} exited with {p.returncode}")
                self.start_api(i)
        for slot, p in list(self.workers.items()):
            if p.poll() is not None and p.pid not in expected:
                self.unexpected_exits.append(f"{slot} ({self.names[slot]}) exited with {p.returncode}")
                self.start_worker(slot)
        sender = self.local.webhooks
        if sender is not None and sender.poll() is not None and sender.pid not in expected:
            self.unexpected_exits.append(f"webhook sender exited with {sender.returncode}")
            self.start_webhooks()

    def reclaims(self) -> int:
        """Entries reclaimed from expired leases, as the workers logged them."""
        pattern = re.compile(r"reclaimed (\d+) request")
        return sum(int(m.group(1)) for f in self.logs.glob("*-w*.log")
                   for m in pattern.finditer(f.read_text()))

    def stop(self) -> None:
        self.local.stop(timeout_s=15)
        if self.cluster is not None:
            self.cluster.stop()


def _pair(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return int(lo), int(hi or lo)


def chaos(
    seconds: float = typer.Option(60, help="Seconds of load and kills (more until the minimums below "
                                           "are met)."),
    min_accepted: int = typer.Option(0, help="Keep the load and the kills going past --seconds until "
                                             "this many requests are accepted: a loaded machine runs "
                                             "longer, not less."),
    min_kills: str = typer.Option("0,0,0", help="The same for kills: at least this many worker, api, "
                                                "Redis (and webhook sender) kills "
                                                "(workers,apis,redis[,webhooks])."),
    max_seconds: float = typer.Option(600, help="The longest the load and kills run, whatever "
                                                "--min-accepted and --min-kills ask."),
    clients: int = typer.Option(12, help="Concurrent clients (each: submit, follow to the end, again)."),
    kill_every: float = typer.Option(3.0, help="Mean seconds between worker kills."),
    api_kill_every: float = typer.Option(15.0, help="Mean seconds between api kills."),
    kill_redis: bool = typer.Option(True, "--kill-redis/--no-kill-redis",
                                    help="Also kill -9 Redis now and then and restart it from its AOF (on a "
                                         "cluster, the primary of a model's slot)."),
    strict: bool = typer.Option(False, "--strict", help="Strict durability (appendfsync always) instead "
                                                        "of the default (everysec)."),
    redis_cluster: bool = typer.Option(False, "--redis-cluster",
                                       help="Run on a local Redis Cluster (3 primaries, 3 replicas; "
                                            "admissions wait for a replica)."),
    redis_kill_every: float = typer.Option(20.0, help="Mean seconds between Redis kills "
                                                      "(with --kill-redis)."),
    webhooks: bool = typer.Option(True, "--webhooks/--no-webhooks",
                                  help="Run a webhook sender and a loopback receiver that fails a third "
                                       "of first attempts; audit every final's event "
                                       "(bench/chaos_webhooks.py)."),
    webhook_kill_every: float = typer.Option(4.0, help="Mean seconds between webhook sender kills "
                                                       "(with --webhooks)."),
    tenants: int = typer.Option(3, help="Tenants the clients send as (client c: tenant c % N, weights "
                                        "1, 2, 1, ...), each with a key and a webhook endpoint of its "
                                        "own; 0 or 1: no keys, one caller."),
    workers_per_model: int = typer.Option(2, help="Null-engine workers per model."),
    token_delay: float = typer.Option(0.02, help="Seconds per streamed token of the null engine."),
    max_tokens: str = typer.Option("8,128", help="max_tokens range per request and row (128 outlast "
                                                 "the lease)."),
    hangups: float = typer.Option(0.25, help="Share of SSE readers that hang up once mid-stream and resume."),
    late_readers: float = typer.Option(0.5, help="Share of followed requests with a second reader "
                                                 "joining late."),
    structured: float = typer.Option(0.15, help="Share of structured requests (background Responses, "
                                                "json_schema)."),
    multi_row: float = typer.Option(0.2, help="Share of multi-row requests (/v1/models/{m}/infer, 2 to 4 "
                                              "rows, on the dynamic model)."),
    drain_timeout: float = typer.Option(90, help="Seconds after the load for every request to become final."),
    seed: int = typer.Option(0, help="Seed of the load and of the kills."),
    json_out: Path = typer.Option(None, "--json", help="Write the figures (and the broken requests) here."),
    logs: Path = typer.Option(None, help="Keep the processes' logs in this folder."),
    data_dir: Path = typer.Option(None, help="Keep the stack's data (Redis's AOF, the apis' data) in a "
                                             "temporary folder under this one (e.g. /dev/shm) instead of "
                                             "the system's temporary folder."),
) -> None:
    """Kill workers, apis, Redis and the webhook sender under load; exit 1 if any accepted request
    is lost, duplicated or not done (nothing in this load cancels, and ten deliveries are allowed),
    if any reader, answer or reply stream shows a text other than the final, or (--webhooks) if a
    final's event never arrived, an event named a request not final, or a duplicate differs; with
    tenants, if a request was stored under another tenant or its event went to another's endpoint."""
    rng, tenancy = random.Random(seed), Tenancy.of(tenants)
    with tempfile.TemporaryDirectory(dir=data_dir) as tmp:
        stack = ChaosStack(Path(tmp), logs or Path(tmp) / "logs", workers_per_model=workers_per_model,
                           token_delay_s=token_delay, strict=strict, cluster=redis_cluster, webhooks=webhooks,
                           tenancy=tenancy)
        receiver = HookReceiver(stack.redis_url, seed=seed) if webhooks else None
        try:
            stack.start()
            if receiver is not None:
                receiver.register(stack.urls[0], tenancy)
            t0 = time.monotonic()
            # The kills stop with the load; clients then follow their last requests to the end.
            chaos_thread = Chaos(stack, rng, math.inf, kill_every, api_kill_every,
                                 redis_kill_every if kill_redis else None,
                                 webhook_kill_every if webhooks else None)
            load = Load(stack.urls, MODEL_NAMES, clients=clients, seed=seed, max_tokens=_pair(max_tokens),
                        hangups=hangups, late_readers=late_readers, structured=structured,
                        multi_row=multi_row, redis_url=None if redis_cluster else stack.redis_url,
                        rows_model="chaos-dyn", tenancy=tenancy)
            chaos_thread.start()
            counts = [int(k) for k in min_kills.split(",")]
            if len(counts) not in (3, 4):
                raise typer.BadParameter("workers,apis,redis[,webhooks]", param_hint="--min-kills")
            wanted = dict(zip(("workers", "apis", "redis", "webhooks"), counts))

            def enough() -> bool:
                now = time.monotonic() - t0
                done = len(load.figures.tracked) >= min_accepted and all(
                    chaos_thread.kills[k] >= n for k, n in wanted.items())
                if now >= max(seconds, max_seconds) or (now >= seconds and done):
                    chaos_thread.calm_at = time.monotonic()
                    return True
                return False

            loaded = asyncio.run(load.run(enough, drain_timeout))
            seconds = chaos_thread.calm_at - t0  # how long the load and kills ran
            chaos_thread.done.set()
            chaos_thread.join()
            result = audit(stack.redis_url, loaded.tracked)
            hooks = None
            if receiver is not None:  # the sender (alive again) delivers the rest, then the audit
                waited, left = wait_delivered(stack.redis_url, receiver, loaded.tracked, drain_timeout)
                hooks = audit_webhooks(stack.redis_url, receiver, loaded.tracked)
                hooks["figures"].update(wait_s=waited, left=left)
            f = {"seconds": seconds, "clients": clients, "tenants": tenancy.names, **result["figures"],
                 "kills": chaos_thread.kills, "reclaims": stack.reclaims(), "queue_full": loaded.queue_full,
                 "tenant_refused": loaded.tenant_refused, "submit_retries": loaded.submit_retries,
                 "submit_gave_up": loaded.submit_gave_up, "rows_unknown": loaded.rows_unknown,
                 "retry_reasons": dict(loaded.retry_reasons.most_common(10)),
                 "unexpected_exits": stack.unexpected_exits, "client_errors": loaded.client_errors[:20],
                 "strict_durability": strict, "redis": "cluster" if redis_cluster else "single",
                 "aof_window": {**chaos_thread.aof, "postponed_logged": stack.aof_postponed_logged()},
                 "webhooks": hooks["figures"] if hooks else None}
            f["requests_per_s"] = f["done"] / seconds
        finally:
            stack.stop()
            if receiver is not None:
                receiver.stop()
    shown = table(f, MODEL_NAMES)
    for name, value in table_rows({**f["webhooks"], "kills": f["kills"]["webhooks"]}) if hooks else []:
        shown.add_row(name, str(value))
    Console().print(shown)
    for row in result["broken"][:20]:
        typer.echo(f"broken: {json.dumps(row)}")
    for line in hooks["broken"] if hooks else []:
        typer.echo(f"webhook broken: {line}")
    for row in result["not_done"][:10]:
        typer.echo(f"not done: {json.dumps(row)}")
    if f["unexpected_exits"] or f["client_errors"]:
        typer.echo(f"unexpected exits: {f['unexpected_exits']}; client errors: {f['client_errors']}")
    if json_out:
        json_out.write_text(json.dumps({**f, "broken": result["broken"], "not_done": result["not_done"],
                                        "webhooks_broken": hooks["broken"] if hooks else [],
                                        "gaps": result["gaps"],
                                        "chaos_log": chaos_thread.log}, indent=2))
    if broken(f) or (hooks and hooks["broken"]):
        raise typer.Exit(1)
