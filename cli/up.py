"""`sluice up`: Redis (local unless configured), the api and one worker, stopped together."""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path

from sluice.api.auth import anonymous_listen_error
from sluice.cli.processes import free_port
from sluice.cli.stack import LocalStack
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

    stack = LocalStack(settings.data_dir, models_file=models_file, redis_url=redis_url, output="inherit", host=host,
                       strict=settings.durability == "strict", env={"SLUICE_DATA_DIR": str(settings.data_dir)},
                       redis_port=free_port(6380))
    stop = {"requested": False}

    def on_signal(signum, _frame) -> None:
        stop["requested"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        stack.start_redis()
        if redis_url is None and stack.redis is not None:
            log.info("started a local redis-server on %s (AOF in %s)", stack.redis_url, stack.redis.data_dir)
        stack.start_worker(default.name)
        stack.start_jobs()
        stack.start_api(port, *(["--allow-anonymous"] if allow_anonymous else []))
        if stack.wait_ready(timeout_s=900, cancelled=lambda: stop["requested"]):
            log.info("Sluice is up at %s serving %s (%.1fs); Ctrl-C stops it", stack.url, default.name,
                     time.monotonic() - t0)
        while not stop["requested"] and all(c.poll() is None for c in stack.processes):
            time.sleep(0.2)
        return 0 if stop["requested"] else 1
    except (RuntimeError, TimeoutError) as err:  # a child died while starting, or never got ready
        log.error("%s", err)
        return 1
    finally:
        log.info("stopping")
        stack.stop()  # the worker first: it drains its requests
