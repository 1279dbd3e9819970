"""What the api's routes share: one Redis client and the broker objects built on it."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request
from redis.asyncio import Redis

from sluice.api.errors import ApiError
from sluice.broker.admission import Admission
from sluice.broker.notifications import DoneListener
from sluice.broker.registry import ModelRegistry, WorkerRegistry
from sluice.config.model import ModelConfig
from sluice.config.settings import Settings


@dataclass
class ApiState:
    settings: Settings
    redis: Redis
    admission: Admission
    models: ModelRegistry
    workers: WorkerRegistry
    default_model: str | None
    done: DoneListener

    async def model(self, name: str | None) -> ModelConfig:
        """The named deployment, or the default one; 404 if there is none."""
        name = name or self.default_model
        if name is None:
            deployed = await self.models.all()
            if not deployed:
                raise ApiError(404, "no model is deployed", code="not_found")
            return deployed[0]
        found = await self.models.get(name)
        if found is None:
            raise ApiError(404, f"model {name!r} is not deployed", code="not_found", param="model")
        return found

    async def model_of(self, rid: str) -> str:
        names = [m.name for m in await self.models.all()]
        model = await self.admission.find_model(rid, names)
        if model is None:
            raise ApiError(404, f"request {rid!r} not found", code="not_found")
        return model


def state(request: Request) -> ApiState:
    return request.app.state.sluice
