"""Run one webhook sender process (`sluice webhooks send`): signals that only set a flag, then
the sender's loops until it is told to stop."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import uuid

from sluice.broker.plumbing.connection import connect, until_redis_answers
from sluice.config.settings import Settings
from sluice.workers import metrics
from sluice.workers.webhooks.sender import WebhookSender

log = logging.getLogger(__name__)


async def serve(settings: Settings, metrics_port: int | None = None) -> None:
    redis = connect(settings.redis_url, name="sluice-webhooks")
    try:
        await until_redis_answers(redis.ping, 60.0)
        if metrics_port is not None:
            metrics.serve(metrics_port, settings.worker_metrics_host)
        # A name of its own each start: what a killed sender held is reclaimed by lease, never resumed.
        name = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        sender = WebhookSender(redis, settings, name)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, sender.stopping.set)
        log.info("webhook sender %s running", sender.name)
        await sender.run()
    finally:
        await redis.aclose()


if __name__ == "__main__":  # `python -m sluice.workers.webhooks.process`: settings from SLUICE_*
    import uvloop

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvloop.run(serve(Settings()))
