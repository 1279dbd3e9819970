"""What the api's routes share: one Redis client and the objects built on it, each with one job.

The container only holds them; `open` and `close` are the lifespan's (api/app.py): deploy the
models file, start the background tasks, and on the way out let the cancels under way reach Redis
before its client closes.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from celery import Celery
from fastapi import Request
from redis.asyncio import Redis

from sluice.api.auth import Scope, load_keys
from sluice.api.cancels import BackgroundCancels
from sluice.api.deployments import Deployments, ModelsFileSync
from sluice.api.expiry import ExpirySweep
from sluice.api.intake import Intake
from sluice.api.lookup import RequestLookup
from sluice.api.slo import SloBounds
from sluice.api.streams import StreamSlots
from sluice.api.tenant_limits import TenantLimits
from sluice.broker.inference_log import LogReads
from sluice.broker.intake.admission import Admission
from sluice.broker.intake.cancels import Cancels
from sluice.broker.intake.quotas import Quotas
from sluice.broker.intake.response_records import ResponseRecords
from sluice.broker.intake.status_reads import StatusReads
from sluice.broker.intake.tenant_streams import TenantStreams
from sluice.broker.jobs.files import FileStore
from sluice.broker.jobs.store import JobStore
from sluice.broker.limits import AdmissionLimits
from sluice.broker.plumbing.connection import connect
from sluice.broker.plumbing.readers import Readers
from sluice.broker.plumbing.urls import celery_broker
from sluice.broker.registry import ModelRegistry, WorkerRegistry
from sluice.broker.replies.notifications import DoneListener
from sluice.broker.replies.router import ReplyRouter
from sluice.config.model import ModelConfig
from sluice.config.settings import Settings
from sluice.config.tenants import Tenants
from sluice.protocol.tokens import PromptLimits

log = logging.getLogger(__name__)

# Cancels of streams cut off at shutdown get this long to reach Redis.
CANCEL_DRAIN_S = 5.0


@dataclass
class ApiState:
    settings: Settings
    redis: Redis
    admission: Admission
    statuses: StatusReads  # a request's status, as its model holds it (or its replicas)
    inference_log: LogReads  # each model's, for the admin
    deployments: Deployments
    models_sync: ModelsFileSync
    expiry: ExpirySweep  # requests past their deadline that no worker started end `expired`
    intake: Intake
    lookup: RequestLookup
    replies: ReplyRouter  # follows the reply streams of every open stream on a few connections
    responses: ResponseRecords  # the Responses API's record beside each response's request
    cancels: BackgroundCancels
    workers: WorkerRegistry
    key_digests: dict[str, Scope]  # digest → scope of each configured key (api/auth.py)
    tenants: Tenants  # each key's tenant, and each tenant's weight, queue share and limits
    files: FileStore
    jobs: JobStore  # OpenAI batches being run
    celery: Celery  # a client only: sends jobs to `sluice jobs` workers
    streams: StreamSlots  # each key's open SSE streams, capped (api/streams.py)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def open(self) -> None:
        """Deploy the models file (a deployment changed at run time is kept), then keep it deployed."""
        try:
            await self.models_sync.sync()
        except Exception as err:  # noqa: BLE001 - the sync task tries again
            log.warning("could not register models in Redis yet (%s); continuing", err)
        await self.preload_tokenizers()
        self.lookup.done.start()
        self.replies.start()
        self._tasks.append(asyncio.create_task(self.models_sync.run(), name="models-file-sync"))
        self._tasks.append(asyncio.create_task(self.expiry.run(), name="expiry-sweep"))
        if self.streams.leases is not None:
            self._tasks.append(asyncio.create_task(self.streams.leases.run(), name="tenant-stream-leases"))

    async def preload_tokenizers(self) -> None:
        """Read the deployed models' tokenizers in a thread before the api takes requests (one
        read on the event loop stalls every connection for about a second); a model deployed
        later is read off the loop at its first use (PromptLimits.load)."""
        models = {m.name: m for m in self.models_sync.models}
        try:
            models.update(await self.deployments.all(fresh=True))
        except Exception as err:  # noqa: BLE001 - Redis away: the models file's are read
            log.warning("could not read the deployments to preload their tokenizers (%s)", err)
        await self.intake.prompt_limits.preload(models.values())

    async def close(self) -> None:
        await self.cancels.drain(CANCEL_DRAIN_S)
        self.models_sync.stop()
        self.expiry.stop()
        if self.streams.leases is not None:
            self.streams.leases.stop()
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=CANCEL_DRAIN_S)
        await self.lookup.done.close()
        await self.replies.close()
        await self.redis.aclose()


def celery_client(settings: Settings) -> Celery:
    """A Celery client only (the api sends jobs; `sluice jobs` runs them), on the jobs' broker."""
    broker, transport = celery_broker(settings.redis_url, settings.jobs_broker_url)
    app = Celery("sluice", broker=broker)
    app.conf.broker_transport_options = transport
    return app


def build_state(settings: Settings, models: list[ModelConfig]) -> ApiState:
    scopes, tenants = load_keys(settings)
    readers = max(1, min(8, settings.api_redis_connections // 8))
    redis = connect(settings.redis_url, name="sluice-api",
                    max_connections=settings.api_redis_connections - readers - 1)
    limits = AdmissionLimits.of(settings)
    admission, statuses = Admission(redis, limits), StatusReads(redis, limits)
    workers = WorkerRegistry(redis)  # the live workers: /v1/workers, readiness and the SLO bound
    deployments = Deployments(ModelRegistry(redis), default_model=models[0].name if models else None,
                              configured=frozenset(m.name for m in models))
    return ApiState(
        settings=settings,
        redis=redis,
        admission=admission,
        statuses=statuses,
        inference_log=LogReads(redis),
        deployments=deployments,
        models_sync=ModelsFileSync(deployments, models),
        expiry=ExpirySweep(redis, deployments, settings),
        intake=Intake(settings, admission, PromptLimits(settings.cache_dir),
                      SloBounds(workers, settings.worker_ttl_s),
                      TenantLimits(Quotas(redis, record_ttl_s=settings.status_ttl_s), tenants)),
        lookup=RequestLookup(statuses, DoneListener(redis), deployments, settings.result_ttl_s),
        replies=ReplyRouter(redis, Readers(settings.redis_url, redis, name="sluice-api-replies",
                                               replicas=settings.redis_wait_replicas > 0), shards=readers),
        responses=ResponseRecords(redis, ttl_s=settings.status_ttl_s + settings.result_ttl_s),
        cancels=BackgroundCancels(Cancels(redis, limits)),
        workers=workers,
        key_digests=scopes,
        tenants=tenants,
        files=FileStore(redis, settings.files_path, settings.max_file_bytes, settings.file_ttl_s,
                        max_files=settings.max_files_per_key),
        jobs=JobStore(redis, settings.batch_ttl_s, settings.result_ttl_s),
        celery=celery_client(settings),
        streams=StreamSlots(settings.max_streams_per_key, tenants,
                            TenantStreams(redis, lease_s=settings.lease_timeout_s)
                            if any(tenants.get(t).max_streams for t in tenants.names()) else None),
    )


async def state(request: Request) -> ApiState:
    # async: FastAPI runs a plain function dependency in its thread pool, a thread hand-off per
    # request (a tenth of the api's CPU on the one-call route)
    return request.app.state.sluice
