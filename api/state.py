"""What the api's routes share: one Redis client and the broker objects built on it."""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from celery import Celery
from fastapi import Request
from redis.asyncio import Redis

from sluice.api.auth import Scope
from sluice.api.errors import ApiError
from sluice.api.metrics import ADMITTED, REJECTED
from sluice.api.tokens import PromptLimits
from sluice.broker.admission import Admission, NotDurable, QueueFull
from sluice.broker.batches import BatchStore
from sluice.broker.files import FileStore
from sluice.broker.notifications import DoneListener
from sluice.broker.registry import ModelRegistry, WorkerRegistry
from sluice.broker.status import RequestStatus
from sluice.config.model import ModelConfig
from sluice.config.settings import Settings
from sluice.protocol.ids import new_request_id, request_created_at
from sluice.protocol.messages import RequestMessage, SamplingSpec

# Cancels started by cancel_soon, kept referenced until they finish.
_cancels: set[asyncio.Task] = set()




@dataclass
class ApiState:
    settings: Settings
    redis: Redis
    admission: Admission
    models: ModelRegistry
    workers: WorkerRegistry
    default_model: str | None
    configured: dict[str, ModelConfig]  # the models file's deployments, re-registered if Redis lost them
    done: DoneListener
    key_digests: dict[str, Scope]  # digest → scope of each configured key (api/auth.py)
    prompt_limits: PromptLimits
    files: FileStore
    batches: BatchStore
    celery: Celery  # a client only: sends jobs to `sluice jobs` workers
    # Deployments read from Redis at most once a second per api process: every request needs
    # them, and a reconfiguration reaching other api replicas a second later is fine.
    deployments_ttl_s: float = 1.0
    _deployments: dict[str, ModelConfig] = field(default_factory=dict)
    _deployments_until: float = 0.0

    async def deployed(self, *, fresh: bool = False) -> dict[str, ModelConfig]:
        now = time.monotonic()
        if fresh or now >= self._deployments_until:
            self._deployments = {m.name: m for m in await self.models.all()}
            self._deployments_until = now + self.deployments_ttl_s
        return self._deployments

    async def model(self, name: str | None) -> ModelConfig:
        """The named deployment, or the default one; 404 if there is none."""
        name = name or self.default_model
        deployed = await self.deployed()
        if name is None:
            if not deployed:
                raise ApiError(404, "no model is deployed", code="not_found")
            return next(iter(sorted(deployed.values(), key=lambda m: m.name)))
        found = deployed.get(name)
        if found is None and name in self.configured:
            found = await self.models.deploy(self.configured[name], keep_existing=True)
            await self.deployed(fresh=True)
        if found is None:
            raise ApiError(404, f"model {name!r} is not deployed", code="not_found", param="model")
        return found

    async def enqueue(self, model: ModelConfig, rows: list[dict[str, Any]], *, temperature: float = 1.0,
                      top_p: float = 1.0, stop: list[str] | None = None, seed: int | None = None,
                      timeout_s: float | None = None, rid: str | None = None,
                      presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                      owner: str | None = None) -> RequestMessage:
        """Admit one request of `rows` for `model` (503 with Retry-After when its queue is full).
        `owner`: the digest of the api key that made it (recorded in its status hash)."""
        (message,) = await self.enqueue_many(
            model, [rows], temperature=temperature, top_p=top_p, stop=stop, seed=seed, timeout_s=timeout_s,
            rids=[rid] if rid else None, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, owner=owner)
        return message

    async def enqueue_many(self, model: ModelConfig, requests: list[list[dict[str, Any]]], *,
                           temperature: float = 1.0, top_p: float = 1.0, stop: list[str] | None = None,
                           seed: int | None = None, timeout_s: float | None = None,
                           rids: list[str] | None = None, presence_penalty: float = 0.0,
                           frequency_penalty: float = 0.0, owner: str | None = None) -> list[RequestMessage]:
        """Admit several requests (each a list of rows; the choices of one completion call)
        all at once or none of them: one admission against the queue bound, so a call is never
        left half-admitted and never counted one by one. Request i gets seed + i."""
        for rows in requests:
            await self._check_rows(model, rows)
        now = time.time()
        seed = seed if seed is not None else secrets.randbits(31)
        messages = [RequestMessage(
            id=rids[i] if rids else new_request_id(),
            model=model.name,
            rows=rows,
            sampling=SamplingSpec(
                max_tokens=rows[0]["max_tokens"], temperature=temperature, top_p=top_p,
                stop=stop or [], seed=seed + i, presence_penalty=presence_penalty,
                frequency_penalty=frequency_penalty,
            ),
            enqueued_at=now,
            deadline=now + (timeout_s or model.request_timeout_s or self.settings.request_timeout_s),
            owner=owner,
        ) for i, rows in enumerate(requests)]
        bound = {"max_queued": model.max_queued or self.settings.max_queued,
                 "result_ttl_s": model.result_ttl_s or self.settings.result_ttl_s}
        try:
            if len(messages) == 1:
                await self.admission.submit(messages[0], **bound)
            else:
                await self.admission.submit_many(messages, **bound)
        except QueueFull:
            REJECTED.labels(model.name, "queue_full").inc(len(messages))
            raise ApiError(503, f"model {model.name!r} is saturated: its queue is full, retry later",
                           code="overloaded", headers={"Retry-After": "1"}) from None
        except NotDurable as err:  # strict durability: not known to be on disk, so not accepted
            raise ApiError(503, f"{err}; retry with the same Idempotency-Key", code="not_durable",
                           headers={"Retry-After": "1"}) from None
        ADMITTED.labels(model.name, messages[0].lane).inc(len(messages))
        return messages

    async def _check_rows(self, model: ModelConfig, rows: list[dict[str, Any]]) -> None:
        """Refuse rows this deployment cannot take; fills in each row's max_tokens."""
        error = model.rows_error(len(rows))
        if error:
            REJECTED.labels(model.name, "batch_size").inc()
            raise ApiError(400, error, param="rows")
        limit = model.framework_config.max_model_len
        for i, row in enumerate(rows):
            # A chat row carries messages; its template is applied by the worker's engine.
            text = row.get("prompt") or "".join(str(m.get("content") or "") for m in row.get("messages", ()))
            if len(text) > self.settings.max_prompt_chars:
                raise ApiError(413, f"prompt: longer than {self.settings.max_prompt_chars} characters",
                               param="prompt")
            row["max_tokens"] = row.get("max_tokens") or model.default_max_tokens
            if limit is not None and row["max_tokens"] >= limit:
                where = "max_tokens" if len(rows) == 1 else f"rows[{i}].max_tokens"
                raise ApiError(422, f"{where}: must be below the model's context length ({limit})",
                               param="max_tokens")
            too_long = await self.prompt_limits.check(model, text, row["max_tokens"])
            if too_long:
                raise ApiError(400, too_long if len(rows) == 1 else f"rows[{i}].{too_long}", param="prompt")

    async def wait_final(self, model: str, rid: str, wait_s: float) -> RequestStatus:
        """The status once the request is final, or as it is after `wait_s`."""
        deadline = time.monotonic() + wait_s
        with self.done.watch(rid) as done:
            while True:
                status = await self.admission.status(model, rid)
                if not status:
                    raise ApiError(404, f"request {rid!r} not found", code="not_found")
                remaining = deadline - time.monotonic()
                if status.final or remaining <= 0:
                    return status
                await self.done.wait(done, remaining)

    def cancel_soon(self, model: str, rid: str) -> None:
        """Cancel from a request task that is itself being torn down (a client went away)."""
        task = asyncio.create_task(self.admission.cancel(model, rid))
        _cancels.add(task)
        task.add_done_callback(_cancels.discard)

    async def model_of(self, rid: str) -> str:
        """The model of a request that Redis still holds; 410 for one whose result expired (its id
        is older than the retention, which is as much as can be known once its keys are gone),
        404 for an id that is young, of another form, or unknown."""
        deployed = await self.deployed()
        model = await self.admission.find_model(rid, list(deployed))
        if model is not None:
            return model
        created = request_created_at(rid)
        retention = min((m.result_ttl_s or self.settings.result_ttl_s for m in deployed.values()),
                        default=self.settings.result_ttl_s)
        if created is not None and time.time() - created > retention:
            raise ApiError(410, f"request {rid!r} expired: a result is kept for {retention} s after the "
                                f"request finishes, and this one is gone", code="expired")
        raise ApiError(404, f"request {rid!r} not found", code="not_found")


async def finish_cancels(timeout_s: float = 5.0) -> None:
    """Let the cancels of streams cut off at shutdown reach Redis before its client closes."""
    if _cancels:
        await asyncio.wait(set(_cancels), timeout=timeout_s)


def state(request: Request) -> ApiState:
    return request.app.state.sluice
