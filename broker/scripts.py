"""The Lua scripts that make each broker change atomic, registered once per client."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

from redis.asyncio import Redis
from redis.commands.core import AsyncScript


def _read(name: str) -> str:
    return resources.files("sluice.broker").joinpath(f"lua/{name}.lua").read_text()


def _source(name: str) -> str:
    """A script with the shared functions of lua/_lib.lua in front (Redis scripts cannot import)."""
    return _read("_lib") + "\n" + _read(name)


@dataclass(frozen=True)
class Scripts:
    admit: AsyncScript
    start: AsyncScript
    lease: AsyncScript
    commit: AsyncScript
    cancel: AsyncScript
    dead_letter: AsyncScript
    reply: AsyncScript
    requeue: AsyncScript
    consumer_drop: AsyncScript
    deploy: AsyncScript  # model deployments (broker/registry.py)
    # bulk jobs (broker/jobs.py)
    job_refresh: AsyncScript
    job_release: AsyncScript
    job_move: AsyncScript
    job_cancel: AsyncScript
    job_put: AsyncScript

    @classmethod
    def register(cls, redis: Redis) -> Scripts:
        return cls(**{name: redis.register_script(_source(name)) for name in cls.__annotations__})
