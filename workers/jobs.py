"""The Celery app that runs bulk jobs (`sluice jobs`), on the same Redis as the queue.

Tasks are acknowledged late and re-queued when their worker dies; a starting Celery worker
also re-dispatches every unfinished batch. Both may start a job twice: the job's lock in
Redis makes the second run wait and then find the job finished.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from celery import Celery
from celery.signals import worker_ready

from sluice.broker.batches import JOB_QUEUE, JOB_TASK, BatchStore
from sluice.broker.connection import connect
from sluice.config.settings import Settings
from sluice.workers.batch_job import BatchJob

log = logging.getLogger(__name__)

QUEUE, RUN_BATCH = JOB_QUEUE, JOB_TASK


def celery_app(settings: Settings) -> Celery:
    app = Celery("sluice", broker=settings.redis_url)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_default_queue=QUEUE,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )

    @app.task(name=RUN_BATCH)
    def run_batch(batch_id: str) -> None:
        asyncio.run(_run(settings, batch_id))

    @worker_ready.connect(weak=False)
    def resume_unfinished(**_) -> None:
        for batch_id in asyncio.run(_unfinished(settings)):
            log.info("re-dispatching unfinished batch %s", batch_id)
            app.send_task(RUN_BATCH, [batch_id], queue=QUEUE)

    return app


async def _run(settings: Settings, batch_id: str) -> None:
    redis = connect(settings.redis_url, name="sluice-jobs")
    try:
        await BatchJob(settings, redis, batch_id).run()
    finally:
        await redis.aclose()


async def _unfinished(settings: Settings) -> list[str]:
    redis = connect(settings.redis_url, name="sluice-jobs")
    try:
        return await BatchStore(redis).unfinished()
    finally:
        await redis.aclose()


def run_worker(settings: Settings) -> None:
    celery_app(settings).worker_main([
        "worker", "--loglevel=INFO", "--pool=threads", f"--concurrency={settings.jobs_concurrency}",
        f"--queues={QUEUE}", f"--hostname=sluice-jobs-{socket.gethostname()}@%h", "--without-gossip",
        "--without-mingle",
    ])
