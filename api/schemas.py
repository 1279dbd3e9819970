"""Bodies and answers of the native HTTP routes."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from sluice.api.errors import ApiError
from sluice.protocol.messages import CallerSeed, MaxTokens, Sampled, SamplingCore
from sluice.protocol.rows import unicode_problem


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


class CallOptions(CallerSeed, SamplingCore):
    """What every native call takes besides its rows: temperature, top_p and seed (declared in
    protocol/messages.py) and its time. The infer route's query parameters; the submit body's
    fields too, with the rest of the sampling."""

    timeout_s: float | None = Field(default=None, gt=0, le=86400)


class SubmitRequest(CallOptions, Sampled):  # stop, penalties and vLLM's sampling extras too, as queued
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(default=None, max_length=128)
    prompt: Text = Field(min_length=1)
    max_tokens: MaxTokens | None = None
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)  # vLLM's: lower first

    @field_validator("stop")
    @classmethod
    def _encodable_stops(cls, stops: list[str]) -> list[str]:
        """A lone surrogate is refused with the body (OpenAI's routes check their stops after it)."""
        return [_encodable(s) for s in stops]


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
