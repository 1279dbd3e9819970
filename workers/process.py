"""Run one worker process: signals that only set flags, then the worker's main loop."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket

from redis.asyncio import Redis

from sluice.broker.plumbing.connection import connect, until_redis_answers
from sluice.broker.registry import ModelRegistry
from sluice.config.model import ConfigError, load_models
from sluice.config.settings import Settings
from sluice.workers import metrics
from sluice.workers.engines.factory import EngineKind, build_engine
from sluice.workers.worker import Worker

log = logging.getLogger(__name__)


async def serve(settings: Settings, model_name: str, name: str | None, engine: EngineKind,
                metrics_port: int | None = None) -> None:
    models = {m.name: m for m in load_models(settings.models_file)}
    redis = connect(settings.redis_url, name="sluice-worker")
    try:
        await _wait_for_redis(redis)
        registry = ModelRegistry(redis)
        if model_name in models:  # a deployment changed at run time is kept
            model = await until_redis_answers(lambda: registry.deploy(models[model_name], keep_existing=True))
        else:
            found = await until_redis_answers(lambda: registry.get(model_name))
            if found is None:
                where, known = settings.models_file or "the models file", ", ".join(models) or "none"
                raise ConfigError(f"model {model_name!r} is neither in {where} nor deployed "
                                  f"({known} are known)")
            model = found
        metrics_url = None
        if metrics_port is not None:
            metrics.serve(metrics_port, settings.worker_metrics_host)
            metrics_url = (settings.worker_metrics_url
                           or f"http://{socket.gethostname()}:{metrics_port}/metrics")
            log.info("metrics on %s", metrics_url)
        worker = Worker(settings, model, build_engine(model, settings, engine), redis,
                        name or f"{socket.gethostname()}-{model.name}", metrics_url=metrics_url,
                        freeze_gc=True)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, _stop_handler(worker, sig))
        await worker.run()
    finally:
        await redis.aclose()


async def _wait_for_redis(redis: Redis, timeout_s: float = 60.0) -> None:
    """A worker started while Redis restarts waits for it (as a Celery worker waits for its
    broker) instead of exiting for its process manager to try again."""
    await until_redis_answers(redis.ping, timeout_s)


def _stop_handler(worker: Worker, sig: signal.Signals):
    def handler() -> None:
        if worker.stopping.is_set():
            log.warning("second %s: exiting now", sig.name)
            raise SystemExit(1)
        log.info("%s: stop fetching, finish running requests", sig.name)
        worker.stopping.set()

    return handler
