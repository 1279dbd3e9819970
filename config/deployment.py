"""A model's deployment: how many replicas of its worker run, and what each one gets.

Named as in the product documents (CPUs, RAM and GPUs per replica). `sluice up` starts the
replicas and gives each its own GPUs (`CUDA_VISIBLE_DEVICES`); `sluice compose` writes them as
compose services with resource limits and GPU reservations.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?)?[Bb]?\s*$", re.IGNORECASE)


def memory_bytes(value: str) -> int:
    """'10Gi' -> 10737418240 (Kubernetes quantities; a trailing B is allowed, '512MB')."""
    found = _MEMORY.match(value)
    if not found:
        raise ValueError(f"{value!r} is not a memory size: write it as 512Mi, 10Gi, 2G or a number of bytes")
    return int(float(found.group(1)) * _UNITS[(found.group(2) or "").upper()])


class DeploymentConfig(BaseModel):
    """Per replica: `cpus` (fractions allowed), `memory` ('10Gi'), `gpus` (whole devices)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    replicas: int = Field(default=1, ge=0, le=256)
    cpus: float | None = Field(default=None, gt=0)
    memory: str | None = None
    gpus: int = Field(default=0, ge=0, le=64)

    @field_validator("memory")
    @classmethod
    def _memory(cls, value: str | None) -> str | None:
        if value is not None and memory_bytes(value) <= 0:
            raise ValueError("memory must be more than 0")
        return value

    @property
    def memory_bytes(self) -> int | None:
        return memory_bytes(self.memory) if self.memory is not None else None

    @property
    def total_gpus(self) -> int:
        return self.replicas * self.gpus


class SLOConfig(BaseModel):
    """A model's latency targets (`slo: {ttft_ms, tpot_ms}`).

    `tpot_ms`: each worker holds the concurrency it admits to the engine where the time per
    output token stays within target (continuous batching). `ttft_ms`: the api refuses an
    interactive request at once (503 with Retry-After) when the requests ahead of it, at the
    rate the model's workers finish them, would keep it from starting within target."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ttft_ms: float | None = Field(default=None, gt=0)
    tpot_ms: float | None = Field(default=None, gt=0)
