"""Which models are deployed, as the api's routes see them, and the models file kept deployed.

Reading never writes. The models file's deployments are registered in Redis by `ModelsFileSync`:
once at startup and again whenever it finds one missing (a Redis that restarted without its
data); a request for such a model meanwhile gets a 503 to retry, and wakes the sync at once.
At startup it also removes the deployments the models file no longer lists.
"""

from __future__ import annotations

import asyncio
import logging
import time

from sluice.api.errors import ApiError
from sluice.broker.registry import ModelRegistry
from sluice.config.model import ModelConfig

log = logging.getLogger(__name__)


class Deployments:
    """Deployments read from Redis at most once per `ttl_s` per api process: every request needs
    them, and a reconfiguration reaching other api replicas a second later is fine."""

    def __init__(self, registry: ModelRegistry, *, default_model: str | None,
                 configured: frozenset[str] = frozenset(), ttl_s: float = 1.0) -> None:
        self.registry = registry
        self.default_model = default_model
        self.configured = configured  # names in the models file: kept deployed by ModelsFileSync
        self.ttl_s = ttl_s
        self.missing = asyncio.Event()  # set when a configured model was asked for and not found
        self._cached: dict[str, ModelConfig] = {}
        self._until = 0.0

    async def all(self, *, fresh: bool = False) -> dict[str, ModelConfig]:
        now = time.monotonic()
        if fresh or now >= self._until:
            self._cached = {m.name: m for m in await self.registry.all()}
            self._until = now + self.ttl_s
        return self._cached

    async def get(self, name: str | None) -> ModelConfig:
        """The named deployment, or the default one; 404 if there is none."""
        name = name or self.default_model
        deployed = await self.all()
        if name is None:
            if not deployed:
                raise ApiError(404, "no model is deployed", code="not_found")
            return deployed[min(deployed)]
        found = deployed.get(name)
        if found is None and name in self.configured:
            self.missing.set()
            raise ApiError(503, f"model {name!r} is being registered again (Redis lost its deployment): "
                                "retry", code="unavailable", headers={"Retry-After": "1"})
        if found is None:
            raise ApiError(404, f"model {name!r} is not deployed", code="not_found", param="model")
        return found

    async def deploy(self, model: ModelConfig) -> ModelConfig:
        """Deploy a changed configuration (the admin route); this process sees it at once."""
        deployed = await self.registry.deploy(model)
        await self.all(fresh=True)
        return deployed


class ModelsFileSync:
    """Keeps the models file's deployments in Redis without undoing a run-time reconfiguration
    (keep_existing). Runs once at startup, then every `interval_s` or when woken by a request
    for a configured model that is missing. Its first pass also undeploys the models that Redis
    holds and the file no longer lists (a model removed from the file stops taking requests once
    the api restarts with it); an api without a models file undeploys nothing."""

    def __init__(self, deployments: Deployments, models: list[ModelConfig], *,
                 interval_s: float = 5.0) -> None:
        self.deployments = deployments
        self.models = models
        self.interval_s = interval_s
        self._stopping = False
        self._retired = False  # the first pass's undeploy is done

    async def sync(self) -> list[str]:
        """Register the models that Redis lacks; the names registered."""
        if not self.models:
            return []
        present = await self.deployments.all(fresh=True)
        if not self._retired:
            await self._retire(present)
        registered = []
        for m in self.models:
            if m.name not in present:
                await self.deployments.registry.deploy(m, keep_existing=True)
                registered.append(m.name)
        if registered:
            await self.deployments.all(fresh=True)
        return registered

    async def _retire(self, present: dict[str, ModelConfig]) -> None:
        listed = {m.name for m in self.models}
        removed = [name for name in sorted(present) if name not in listed
                   and await self.deployments.registry.undeploy(name)]
        if removed:
            log.info("undeployed %s: no longer in the models file", removed)
            await self.deployments.all(fresh=True)
        self._retired = True

    async def run(self) -> None:
        """Until `stop`; a failed pass (Redis away) is logged and tried again. The first pass is
        the caller's (at startup, before requests are taken)."""
        while not self._stopping:
            try:
                await asyncio.wait_for(self.deployments.missing.wait(), self.interval_s)
            except TimeoutError:
                pass
            if self._stopping:
                return
            self.deployments.missing.clear()
            try:
                registered = await self.sync()
                if registered:
                    log.info("registered the models file's deployments %s in Redis", registered)
            except Exception as err:  # noqa: BLE001 - Redis may be starting or gone: try again
                log.warning("could not register the models file's deployments in Redis (%s); retrying", err)

    def stop(self) -> None:
        # A flag as well as the cancel that follows: redis-py can swallow a cancel that lands
        # while it connects (see broker/replies/notifications.py), and the loop would go on.
        self._stopping = True
        self.deployments.missing.set()
