"""`sluice up`: Redis (local unless configured), the api, every model's worker replicas and
the jobs worker, stopped together.

The console shows Sluice's own progress in a few lines; each process writes its detail (the
engine's load, the access log) to a file under <data dir>/logs, or to the console with
--verbose.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

from sluice.api.auth import anonymous_listen_error, configured_keys
from sluice.cli.replicas import DeploymentError, Replica, plan_replicas
from sluice.cli.running import DataDirBusy, UpLock
from sluice.config.model import DEFAULT_MODEL_PATH, ModelConfig, load_models
from sluice.config.settings import Settings
from sluice.supervisor.processes import free_port
from sluice.supervisor.stack import LocalStack

log = logging.getLogger("sluice.up")


def _reachable(url: str) -> bool:
    import redis

    from sluice.broker.plumbing.urls import sync_connect

    try:
        return bool(sync_connect(url, socket_connect_timeout=3, socket_timeout=3).ping())
    except (redis.RedisError, OSError):
        return False


def _port_taken(host: str, port: int) -> str | None:
    """Why the api could not listen on host:port, or None (checked before anything starts)."""
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        return f"cannot listen on {host}:{port}: {err}"
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind(addr)
        except OSError as err:
            return (f"port {port} on {host} is taken ({err.strerror}): stop what holds it, "
                    "or choose another with --port or SLUICE_API_PORT")
    return None


def _last_lines(path: Path, n: int = 3) -> str:
    """The end of a process's log, for the console: why it stopped."""
    try:
        lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return "\n".join(f"  | {x[:200]}" for x in lines[-n:])


def _exited(stack: LocalStack, proc) -> str:
    """"<process> exited with N", and the end of its log."""
    name = next((n for n, p in stack.workers.items() if p is proc), None)
    log_name = f"{name}.log" if name else "jobs.log" if proc is stack.jobs else \
        "webhooks.log" if proc is stack.webhooks else "api.log"
    what = f"worker {name}" if name else "the jobs worker" if proc is stack.jobs else \
        "the webhook sender" if proc is stack.webhooks else "the api"
    logs = stack.logs_dir or stack.data_dir / "logs"
    tail = _last_lines(logs / log_name) if stack.output == "logs" else ""
    return (f"{what} exited with {proc.returncode}; its log is {logs / log_name}"
            + (f":\n{tail}" if tail else ""))


def _prepare(models: list[ModelConfig], settings: Settings) -> bool:
    if not any(m.path == DEFAULT_MODEL_PATH for m in models):
        return True
    from sluice.workers.model_prep import ModelPrepError, is_prepared, prepare_default_model

    if not is_prepared(settings.cache_dir):
        log.info("preparing the default model (once)")
    try:
        prepare_default_model(settings.cache_dir)
    except ModelPrepError as err:
        log.error("%s", err)
        return False
    return True


def _live_workers(redis_url: str, ttl_s: float) -> dict[str, dict]:
    import json

    import redis

    from sluice.broker.keys import WORKERS
    from sluice.broker.plumbing.urls import sync_connect

    try:
        with sync_connect(redis_url, socket_timeout=3) as r:
            beats = r.hgetall(WORKERS)
    except (redis.RedisError, OSError):
        return {}
    now = time.time()
    infos = {k: json.loads(v) for k, v in beats.items()}
    return {k: info for k, info in infos.items() if now - info.get("heartbeat_at", 0) <= ttl_s}


def _wait_ready(stack: LocalStack, replicas: list[Replica], stop: dict, ttl_s: float,
                timeout_s: float = 900) -> bool:
    """Until every replica has registered and the api answers; says so for each worker."""
    t0 = time.monotonic()
    seen: set[str] = set()
    api_ok = False
    while time.monotonic() - t0 < timeout_s:
        if stop["requested"]:
            return False
        for p in stack.processes:
            if p.poll() is not None:
                raise RuntimeError(f"while starting, {_exited(stack, p)}")
        live = _live_workers(stack.redis_url or "", ttl_s)  # as the api's WorkerRegistry.live counts them
        for r in replicas:
            if r.name in live and r.name not in seen:
                seen.add(r.name)
                url = live[r.name].get("metrics_url")
                log.info("worker %s ready (%.0fs)%s", r.name, time.monotonic() - t0,
                         f"; metrics at {url}" if url else "")
        if not api_ok:
            try:
                api_ok = httpx.get(f"{stack.url}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                pass
        if api_ok and len(seen) == len(replicas):
            return True
        time.sleep(0.5)
    raise TimeoutError(f"not ready after {timeout_s:.0f}s: waiting for "
                       f"{', '.join(r.name for r in replicas if r.name not in seen) or 'the api'}")


def run_up(redis_url: str | None, host: str, port: int, models_file: Path | None, *,
           allow_anonymous: bool = False, verbose: bool = False) -> int:
    t0 = time.monotonic()
    settings = Settings(models_file=models_file) if models_file else Settings()
    # The api would refuse too, but only after Redis and the model were started for nothing.
    refused = anonymous_listen_error(host, configured_keys(settings), allow_anonymous)
    if refused:
        log.error("%s", refused)
        return 2
    models = load_models(settings.models_file)
    try:
        replicas = plan_replicas(models)
    except DeploymentError as err:
        log.error("%s", err)
        return 2
    if redis_url is not None and not _reachable(redis_url):
        log.error("no Redis answers at %s (from --redis-url or SLUICE_REDIS_URL); leave both unset "
                  "to run a local one", redis_url)
        return 2
    taken = _port_taken(host, port)
    if taken:
        log.error("%s", taken)
        return 2
    try:  # one sluice up per data directory: a second one would start a second Redis on the same AOF
        lock = UpLock(settings.data_dir).acquire()
    except DataDirBusy as err:
        log.error("%s", err)
        return 2
    try:
        return _run(lock, models, replicas, settings, redis_url, host, port, models_file, t0,
                    allow_anonymous=allow_anonymous, verbose=verbose)
    finally:
        lock.release()


def _run(lock: UpLock, models: list[ModelConfig], replicas: list[Replica], settings: Settings,
         redis_url: str | None, host: str, port: int, models_file: Path | None, t0: float, *,
         allow_anonymous: bool, verbose: bool) -> int:
    if not _prepare(models, settings):
        return 2
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the readiness polls
    logs = settings.data_dir / "logs"
    stack = LocalStack(settings.data_dir, models_file=models_file, redis_url=redis_url, host=host,
                       output="inherit" if verbose else "logs", logs_dir=logs,
                       strict=settings.durability == "strict",
                       env={"SLUICE_DATA_DIR": str(settings.data_dir)},
                       redis_port=free_port(6380), own_session=True)
    stop = {"requested": False}

    def on_signal(signum, _frame) -> None:
        stop["requested"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    # the terminal closed: the children, in their own sessions, would stay
    signal.signal(signal.SIGHUP, on_signal)
    try:
        lock.record_redis(stack.start_redis())  # `sluice dlq` and the like find it there
        if redis_url is None and stack.redis is not None:
            log.info("started a local redis-server on %s (AOF in %s)", stack.redis_url, stack.redis.data_dir)
        if not verbose:
            log.info("process logs in %s (--verbose shows them here)", logs)
        metrics_host = "127.0.0.1" if host in ("127.0.0.1", "localhost", "::1") else "0.0.0.0"
        for r in replicas:
            mport = free_port()
            where = ", ".join(filter(None, [f"GPUs {','.join(r.gpus)}" if r.gpus else None,
                                            f"cores {','.join(map(str, r.cpus))}" if r.cpus else None]))
            log.info("starting worker %s for %s%s; its engine loads now", r.name, r.model,
                     f" on {where}" if where else "")
            stack.start_worker(r.model, r.name, SLUICE_WORKER_METRICS_PORT=str(mport),
                               SLUICE_WORKER_METRICS_HOST=metrics_host,
                               SLUICE_WORKER_METRICS_URL=f"http://127.0.0.1:{mport}/metrics", **r.env)
        stack.start_jobs()
        stack.start_webhooks()  # the webhook sender (docs/webhooks.md)
        # One api process per four cores, up to four (SLUICE_API_WORKERS overrides): the workers'
        # engines and Redis need the rest.
        api_processes = (os.environ.get("SLUICE_API_WORKERS")
                         or str(max(1, min(4, (os.cpu_count() or 1) // 4))))
        stack.start_api(port, "--workers", api_processes, *(["--allow-anonymous"] if allow_anonymous else []),
                        log="api")
        if _wait_ready(stack, replicas, stop, settings.worker_ttl_s):
            served = ", ".join(f"{m.name} x{m.deployment.replicas}" for m in models)
            log.info("Sluice is up at %s serving %s (%.1fs); workers and their metrics: %s/v1/workers; "
                     "Ctrl-C stops it", stack.url, served, time.monotonic() - t0, stack.url)
        while not stop["requested"]:
            dead = next((c for c in stack.processes if c.poll() is not None), None)
            if dead is not None:
                log.error("%s; stopping the rest", _exited(stack, dead))
                return 1
            time.sleep(0.2)
        return 0
    except (RuntimeError, TimeoutError) as err:
        # a child died while starting, never got ready, or no redis-server
        log.error("%s", err)
        return 1
    finally:
        log.info("stopping")
        stack.stop()  # the workers first: they drain their requests
        _say_stopped(stack)


def _say_stopped(stack: LocalStack) -> None:
    """"stopped", and whatever is still running (nothing should be)."""
    left = [f"{_command(p)} (pid {p.pid})" for p in stack.processes if p.poll() is None]
    if left:
        log.warning("stopped; still running: %s", ", ".join(left))
    else:
        log.info("stopped; nothing it started is left running")


def _command(proc: subprocess.Popen) -> str:
    """A child's sluice command and its first options ("worker --model m"), after the interpreter's."""
    args = proc.args if isinstance(proc.args, list) else [proc.args]
    return " ".join(map(str, args[3:6]))
