"""Deployed models (with versions) and live workers, kept in two Redis hashes."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass

from redis.asyncio import Redis

from sluice.broker.keys import MODELS, WORKERS
from sluice.broker.plumbing import Key, ScriptCall, Scripts, hash_of, maybe_text, text
from sluice.config.model import ModelConfig, parse_model

# A stored deployment is "<version>\n<fingerprint>\n<config json>" (lua/deploy.lua).


@dataclass(frozen=True)
class Deploy(ScriptCall):
    """deploy.lua: store a deployment, versioned (a changed configuration gets the next version)."""

    script = "deploy"
    models: Key  # the models hash
    name: str
    fingerprint: str
    config: str  # its JSON
    keep_existing: str  # '1': a stored deployment wins


def _decode(name: str, stored: str) -> ModelConfig:
    version, _fingerprint, config = stored.split("\n", 2)
    data = json.loads(config)
    data["version"] = int(version)
    return parse_model(data, f"{MODELS}[{name}]")


class ModelRegistry:
    def __init__(self, redis: Redis):
        self.redis = redis
        self.scripts = Scripts(redis)

    async def deploy(self, model: ModelConfig, *, keep_existing: bool = False) -> ModelConfig:
        """Store a deployment; a changed one gets the next version, an unchanged one keeps its own.

        With keep_existing, a deployment already in Redis wins (processes starting from the
        YAML file must not undo a reconfiguration made at run time).
        """
        config = json.dumps(model.deployment_key(), sort_keys=True)
        fingerprint = hashlib.sha256(config.encode()).hexdigest()[:16]
        stored = await self.scripts(Deploy(models=MODELS, name=model.name, fingerprint=fingerprint,
                                           config=config, keep_existing="1" if keep_existing else "0"))
        return _decode(model.name, text(stored))

    async def undeploy(self, name: str) -> bool:
        """Remove a deployment (a model dropped from the models file); whether it was there. Its
        workers keep draining what they hold; the api stops admitting requests for it."""
        return bool(await self.redis.hdel(MODELS, name))

    async def get(self, name: str) -> ModelConfig | None:
        stored = maybe_text(await self.redis.hget(MODELS, name))
        return _decode(name, stored) if stored else None

    async def all(self) -> list[ModelConfig]:
        stored = hash_of(await self.redis.hgetall(MODELS))
        return sorted((_decode(k, v) for k, v in stored.items()), key=lambda m: m.name)


@dataclass
class WorkerInfo:
    name: str
    model: str
    version: int
    mode: str
    pid: int
    host: str
    in_flight: int
    capacity: int
    started_at: float
    heartbeat_at: float
    state: str = "running"  # running | draining
    metrics_url: str | None = None  # its Prometheus endpoint, when it serves one
    admitted: int | None = None  # requests it admits to the engine at once (capacity, or the SLO's limit)
    service_rate: float = 0.0  # requests/s it finishes at that concurrency (0: not known yet)
    # its engine's prefix-cache counters so far, in prompt tokens (None: no prefix cache)
    prefix_cache_queries: int | None = None
    prefix_cache_hits: int | None = None
    prefix_cache_blocks: int | None = None  # the cache's size in KV-cache blocks (None: not known)
    prefix_cache_block_size: int | None = None  # tokens per block


class WorkerRegistry:
    def __init__(self, redis: Redis):
        self.redis = redis

    async def beat(self, info: WorkerInfo) -> None:
        info.heartbeat_at = time.time()
        await self.redis.hset(WORKERS, info.name, json.dumps(asdict(info)))

    async def remove(self, name: str) -> None:
        await self.redis.hdel(WORKERS, name)

    async def live(self, ttl_s: float) -> list[WorkerInfo]:
        """Workers with a recent heartbeat; long-dead entries are pruned on the way."""
        now = time.time()
        out, dead = [], []
        for name, raw in (await self.redis.hgetall(WORKERS)).items():
            info = WorkerInfo(**json.loads(raw))
            if now - info.heartbeat_at <= ttl_s:
                out.append(info)
            elif now - info.heartbeat_at > 10 * ttl_s:
                dead.append(name)
        if dead:
            await self.redis.hdel(WORKERS, *dead)
        return sorted(out, key=lambda w: w.name)
