"""`sluice up`: Redis (local unless configured), the api and one worker, stopped together."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from sluice.api.auth import anonymous_listen_error
from sluice.broker.embedded import EmbeddedRedis
from sluice.cli.processes import stop_processes, wait_ready
from sluice.config.model import DEFAULT_MODEL_PATH, load_models
from sluice.config.settings import Settings

log = logging.getLogger("sluice.up")


def _reachable(url: str) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3).ping())
    except (redis.RedisError, OSError):
        return False


def run_up(redis_url: str | None, host: str, port: int, models_file: Path | None, *,
           allow_anonymous: bool = False) -> int:
    t0 = time.monotonic()
    settings = Settings(**({"models_file": models_file} if models_file else {}))
    # The api would refuse too, but only after Redis and the model were started for nothing.
    refused = anonymous_listen_error(host, settings.api_keys, allow_anonymous)
    if refused:
        log.error("%s", refused)
        return 2
    models = load_models(settings.models_file)
    default = models[0]
    if redis_url is not None and not _reachable(redis_url):
        log.error("no Redis answers at %s (from --redis-url or SLUICE_REDIS_URL); leave both unset "
                  "to run a local one", redis_url)
        return 2
    if any(m.path == DEFAULT_MODEL_PATH for m in models):
        from sluice.workers.model_prep import ModelPrepError, is_prepared, prepare_default_model

        if not is_prepared(settings.cache_dir):
            log.info("preparing the default model (once)")
        try:
            prepare_default_model(settings.cache_dir)
        except ModelPrepError as err:
            log.error("%s", err)
            return 2

    redis: EmbeddedRedis | None = None
    if redis_url is None:
        redis = EmbeddedRedis(settings.data_dir / "redis", strict=settings.durability == "strict").start()
        redis_url = redis.url
        log.info("started a local redis-server on %s (AOF in %s)", redis_url, redis.data_dir)
    env = {**os.environ, "SLUICE_REDIS_URL": redis_url}
    if models_file:
        env["SLUICE_MODELS_FILE"] = str(models_file)
    cli = [sys.executable, "-m", "sluice.cli"]
    children = [
        subprocess.Popen([*cli, "api", "--host", host, "--port", str(port),
                          *(["--allow-anonymous"] if allow_anonymous else [])], env=env),
        subprocess.Popen([*cli, "worker", "--model", default.name], env=env),
        subprocess.Popen([*cli, "jobs"], env=env),
    ]
    stop = {"requested": False}

    def on_signal(signum, _frame) -> None:
        stop["requested"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    try:
        if wait_ready(base, children, cancelled=lambda: stop["requested"]):
            log.info("Sluice is up at %s serving %s (%.1fs); Ctrl-C stops it", base, default.name,
                     time.monotonic() - t0)
        while not stop["requested"] and all(c.poll() is None for c in children):
            time.sleep(0.2)
        return 0 if stop["requested"] else 1
    except (RuntimeError, TimeoutError) as err:  # a child died while starting, or never got ready
        log.error("%s", err)
        return 1
    finally:
        log.info("stopping")
        stop_processes(list(reversed(children)))  # the worker first: it drains its requests
        if redis:
            redis.stop()
