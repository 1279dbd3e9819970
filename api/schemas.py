"""Bodies and answers of the native HTTP routes."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from sluice.api.errors import ApiError
from sluice.protocol.messages import SamplingExtras
from sluice.protocol.openai import stop_list
from sluice.protocol.rows import MAX_TOKENS, unicode_problem  # also imported from here


def require_unicode(value: object, where: str) -> None:
    """A 422 naming `where` when `value` holds a string that cannot be encoded."""
    problem = unicode_problem(value)
    if problem:
        raise ApiError(422, f"{where}: {problem}", param=where.rsplit(".", 1)[-1])


def _encodable(value: str) -> str:
    problem = unicode_problem(value)
    if problem:
        raise ValueError(problem)
    return value


Text = Annotated[str, AfterValidator(_encodable)]


class SubmitRequest(SamplingExtras):  # penalties and vLLM's sampling extras, as queued
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(default=None, max_length=128)
    prompt: Text = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    timeout_s: float | None = Field(default=None, gt=0, le=86400)
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)  # vLLM's: lower first

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        return [_encodable(s) for s in stop_list(value)]


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
