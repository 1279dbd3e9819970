"""OpenAI request bodies and response objects, shared by the api's routes and by batch jobs
(whose input lines carry the same bodies). Fields Sluice does not serve are refused by name."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from sluice.protocol.messages import FinalResult


def stop_list(value: str | list[str] | None) -> list[str]:
    stops = [value] if isinstance(value, str) else list(value or [])
    if len(stops) > 16:
        raise ValueError("at most 16 stop strings")
    if any(not s for s in stops):
        raise ValueError("stop strings must not be empty")
    return stops


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(default=None, max_length=128)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> list[str]:
        return stop_list(value)

    def unsupported(self) -> list[str]:
        """Fields a client set that this server does not implement."""
        return []


class CompletionRequest(SamplingBody):
    prompt: str | list[str]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value: str | list[str]) -> list[str]:
        prompts = [value] if isinstance(value, str) else value
        if not prompts or any(not p for p in prompts):
            raise ValueError("prompt must be a non-empty string or list of non-empty strings")
        return prompts

    def unsupported(self) -> list[str]:
        out = ["logprobs"] if self.logprobs is not None else []
        out += ["echo"] if self.echo else []
        out += ["suffix"] if self.suffix else []
        out += ["best_of"] if self.best_of not in (None, self.n) else []
        return out


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def plain(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_limit(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self

    def unsupported(self) -> list[str]:
        out = ["logprobs"] if self.logprobs else []
        out += ["tools"] if self.tools else []
        rf = (self.response_format or {}).get("type", "text")
        out += ["response_format"] if rf != "text" else []
        return out


def usage(finals: list[FinalResult]) -> dict[str, int]:
    prompt = sum(f.usage.prompt_tokens for f in finals if f.usage)
    completion = sum(f.usage.completion_tokens for f in finals if f.usage)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _reason(f: FinalResult) -> str:
    return (f.output.finish_reason if f.output else None) or "stop"


def completion_object(cid: str, model: str, created: int, finals: list[FinalResult]) -> dict[str, Any]:
    choices = [{"index": i, "text": f.output.text if f.output else "", "logprobs": None,
                "finish_reason": _reason(f)} for i, f in enumerate(finals)]
    return {"id": cid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage(finals)}


def chat_object(cid: str, model: str, created: int, finals: list[FinalResult]) -> dict[str, Any]:
    choices = [{"index": i, "message": {"role": "assistant", "content": f.output.text if f.output else ""},
                "logprobs": None, "finish_reason": _reason(f)} for i, f in enumerate(finals)]
    return {"id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage(finals)}
