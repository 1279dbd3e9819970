"""Bodies and answers of the native HTTP routes."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sluice.broker.openai import stop_list


class SubmitRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(default=None, max_length=128)
    prompt: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    timeout_s: float | None = Field(default=None, gt=0, le=86400)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        return stop_list(value)


class Submitted(BaseModel):
    id: str
    status: str
    model: str


class RequestView(BaseModel):
    id: str
    model: str
    status: str
    output: dict[str, Any] | None = None
    rows: list[dict[str, Any]] | None = None
    error: str | None = None
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] = Field(default_factory=dict)
    attempt: int | None = None
