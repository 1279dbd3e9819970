"""The Celery app that runs bulk jobs (`sluice jobs`), on the same Redis as the queue.

Tasks are acknowledged late and re-queued when their worker dies; a starting Celery worker
also re-dispatches the unfinished batches whose runner is gone (no live lock). A job started
twice still has one runner: the job's lock in Redis makes the second run wait for a gone
runner's lock to lapse, or leave the job to the live runner that holds it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable

from celery import Celery
from celery.signals import worker_ready

from sluice.broker.jobs.store import JobStore
from sluice.broker.plumbing.connection import connect
from sluice.broker.plumbing.urls import celery_broker
from sluice.config.settings import Settings
from sluice.protocol.tasks import JOB_QUEUE, JOB_TASK
from sluice.workers.jobs.runner import JobRunner

log = logging.getLogger(__name__)

QUEUE, RUN_BATCH = JOB_QUEUE, JOB_TASK


def celery_app(settings: Settings) -> Celery:
    broker, transport = celery_broker(settings.redis_url, settings.jobs_broker_url)
    app = Celery("sluice", broker=broker)
    app.conf.update(
        broker_transport_options=transport,
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

    def dispatch(batch_id: str) -> None:
        app.send_task(RUN_BATCH, [batch_id], queue=QUEUE)

    @worker_ready.connect(weak=False)
    def on_worker_ready(**_) -> None:
        # Telling a dead runner's lock from a live one takes up to one lock TTL: not on the
        # thread that starts the worker.
        threading.Thread(target=asyncio.run, args=(_resume(settings, dispatch),), name="sluice-jobs-resume",
                         daemon=True).start()

    return app


async def _run(settings: Settings, batch_id: str) -> None:
    redis = connect(settings.redis_url, name="sluice-jobs")
    try:
        await JobRunner(settings, redis, batch_id).run()
    finally:
        await redis.aclose()


async def _resume(settings: Settings, dispatch: Callable[[str], None]) -> None:
    redis = connect(settings.redis_url, name="sluice-jobs")
    try:
        await resume_orphans(JobStore(redis), dispatch)
    finally:
        await redis.aclose()


async def resume_orphans(store: JobStore, dispatch: Callable[[str], None]) -> None:
    """Dispatch each unfinished job whose runner is gone, as soon as that is known; a job whose
    runner is alive elsewhere is left to it."""
    async def resume(batch_id: str) -> None:
        if not await store.runner_alive(batch_id):
            log.info("re-dispatching unfinished batch %s (its runner is gone)", batch_id)
            await asyncio.to_thread(dispatch, batch_id)

    await asyncio.gather(*(resume(batch_id) for batch_id in await store.unfinished()))


def run_worker(settings: Settings) -> None:
    celery_app(settings).worker_main([
        "worker", "--loglevel=INFO", "--pool=threads", f"--concurrency={settings.jobs_concurrency}",
        f"--queues={QUEUE}", f"--hostname=sluice-jobs-{socket.gethostname()}@%h", "--without-gossip",
        "--without-mingle",
    ])
