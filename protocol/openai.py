"""OpenAI request bodies, shared by the api's routes and by batch jobs (whose input lines
carry the same bodies). Fields Sluice does not serve are refused by name; the response
objects are in openai_objects.py, tools in openai_tools.py."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from sluice.protocol.messages import CallerSeed, Sampled, SamplingExtras, StructuredSpec, declared
from sluice.protocol.openai_objects import Shape
from sluice.protocol.openai_tools import AUTO, REQUIRED, NamedToolChoice, Tool, tool_calls_schema
from sluice.protocol.structured import from_fields, from_response_format
from sluice.protocol.structured import problem as structured_problem


class StreamOptions(BaseModel):
    include_usage: bool = False


Problem = tuple[str, str]  # (the field, what is wrong with it): a 400 naming the field

# vLLM's own names for constrained decoding: its `structured_outputs` object, and the older
# top-level `guided_*` fields, mapped to StructuredSpec's fields.
_STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                    "json_object": "json_object"}
_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


class SamplingBody(Sampled, CallerSeed):
    """What completions and chat bodies share; the sampling (temperature, top_p, stop, seed) and
    vLLM's sampling extras (its OpenAI server takes them as extra body fields) come from their
    one declaration (protocol/messages.py), an extra's null standing for its default (OpenAI's
    SDKs may send a null)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(default=None, max_length=128)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)  # vLLM's: lower first

    @model_validator(mode="before")
    @classmethod
    def _null_extras(cls, data: Any) -> Any:
        """A null sampling extra is its default, as an absent one."""
        if isinstance(data, dict) and any(data.get(name, 0) is None for name in SamplingExtras.model_fields):
            return {k: v for k, v in data.items() if not (v is None and k in SamplingExtras.model_fields)}
        return data

    def constrained(self) -> bool:
        """Whether a field of a structured output is set (checking one compiles it: off the loop)."""
        fields = ("response_format", "structured_outputs", *_GUIDED)
        return any(getattr(self, name) is not None for name in fields)

    def problems(self) -> list[Problem]:
        """Fields a client set that this server does not serve, or cannot serve together."""
        out: list[Problem] = []
        if self.logit_bias:
            out.append(("logit_bias", "logit_bias: not supported by this server"))
        try:
            self.structured()
        except ValueError as err:
            out.append((str(err).partition(": ")[0], str(err)))
        return out

    def structured(self) -> StructuredSpec | None:
        """The constraint on the output, from whichever of OpenAI's `response_format`, vLLM's
        `structured_outputs` or its `guided_*` fields the client used (at most one of them).
        Raises ValueError("field: why") when it is malformed."""
        found: list[tuple[str, StructuredSpec]] = []
        if self.response_format is not None:
            spec = from_response_format(self.response_format)
            if spec is not None:
                found.append(("response_format", spec))
        if self.structured_outputs:
            unknown = sorted(set(self.structured_outputs) - set(_STRUCTURED_KEYS) - {"disable_any_whitespace",
                                                                                      "whitespace_pattern"})
            if unknown:
                raise ValueError(f"structured_outputs: unknown field {unknown[0]!r} (one of json, regex, "
                                 "choice, grammar, json_object)")
            given = {_STRUCTURED_KEYS[k]: v for k, v in self.structured_outputs.items()
                     if k in _STRUCTURED_KEYS and v not in (None, False)}
            found.append(("structured_outputs", from_fields("structured_outputs", given)))
        for name, key in _GUIDED.items():
            value = getattr(self, name)
            if value is not None:
                found.append((name, from_fields(name, {key: json.loads(value) if key == "json_schema"
                                                 and isinstance(value, str) else value})))
        if len(found) > 1:
            raise ValueError(f"{found[1][0]}: only one constraint on the output at a time "
                             f"({found[0][0]} is set too)")
        if not found:
            return None
        param, spec = found[0]
        why = structured_problem(spec)
        if why is not None:
            raise ValueError(f"{param}: the engine cannot decode with it: {why}")
        return spec

    def sampling_fields(self) -> dict[str, Any]:
        """SamplingSpec's fields from this body, but for max_tokens and the seed."""
        return {**declared(self, Sampled), "structured": self.structured(), "priority": self.priority}


class CompletionRequest(SamplingBody):
    prompt: str | list[str]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
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

    def problems(self) -> list[Problem]:
        out = super().problems()
        if self.suffix:
            out.append(("suffix", "suffix: not supported by this server"))
        if self.best_of not in (None, self.n):
            out.append(("best_of", "best_of: not supported by this server (only best_of = n)"))
        return out

    def sampling_fields(self) -> dict[str, Any]:
        lp = self.logprobs
        return {**super().sampling_fields(), "logprobs": lp, "prompt_logprobs": lp if self.echo else None}

    def shape(self) -> Shape:
        return Shape(chat=False, logprobs=self.logprobs, echo=self.echo)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def plain(self) -> dict[str, Any]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatCompletionRequest(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    _parser: str | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _one_limit(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self

    def constrained(self) -> bool:
        return super().constrained() or self.tools is not None or self.tool_choice is not None

    def problems(self) -> list[Problem]:
        out = super().problems()
        if self.top_logprobs is not None and not self.logprobs:
            out.append(("top_logprobs", "top_logprobs: needs logprobs: true"))
        try:
            self.tool_mode()
        except ValueError as err:
            out.append((str(err).partition(": ")[0], str(err)))
        return out

    def tool_mode(self) -> str | None:
        """None (no tools, or tool_choice "none"), REQUIRED, AUTO (with the deployment's
        tool-call parser, set by with_parser()), or the name of the one function that must be
        called. Raises ValueError("field: why")."""
        choice = self.tool_choice or ("auto" if self.tools else "none")
        if choice == "none":
            return None
        if not self.tools:
            raise ValueError("tool_choice: needs tools")
        if choice == "auto":
            if self._parser is None:
                raise ValueError('tool_choice: "auto" needs a tool-call parser, and this deployment names '
                                 'none (tool_call_parser in its configuration); use "required" or name a '
                                 'function')
            return AUTO
        if self.response_format not in (None, {"type": "text"}) or self.structured_outputs:
            raise ValueError("tool_choice: a tool call and response_format cannot both constrain the output")
        if choice == "required":
            return REQUIRED
        names = [t.function.name for t in self.tools]
        if choice.function.name not in names:
            raise ValueError(f"tool_choice: no tool named {choice.function.name!r} "
                             f"(tools: {', '.join(names)})")
        return choice.function.name

    def with_parser(self, parser: str | None) -> ChatCompletionRequest:
        """The deployment's tool-call parser, which `tool_choice: "auto"` needs."""
        self._parser = parser
        return self

    def _tool(self) -> str | None:
        """tool_mode(), or None where it is refused (problems() says why)."""
        try:
            return self.tool_mode()
        except ValueError:
            return None

    def structured(self) -> StructuredSpec | None:
        spec = super().structured()
        mode = self._tool()
        if mode is None or mode == AUTO:  # "auto": generated freely, then parsed
            return spec
        tools = {t.function.name: t.function.parameters or {"type": "object"} for t in self.tools or []}
        spec = StructuredSpec(json_schema=tools[mode] if mode != REQUIRED else tool_calls_schema(tools))
        why = structured_problem(spec)
        if why is not None:
            raise ValueError("tools: a function's parameters are not a schema the engine can decode "
                             f"with: {why}")
        return spec

    def sampling_fields(self) -> dict[str, Any]:
        return {**super().sampling_fields(), "logprobs": (self.top_logprobs or 0) if self.logprobs else None}

    def shape(self) -> Shape:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return Shape(chat=True, logprobs=logprobs, tool=self._tool())

    def rows(self) -> dict[str, Any]:
        """What the worker renders: the messages, and the tools for the chat template."""
        row: dict[str, Any] = {"messages": [m.plain() for m in self.messages]}
        if self.tools and self.tool_choice != "none":
            row["tools"] = [t.model_dump(exclude_none=True) for t in self.tools]
            if self._tool() == AUTO:
                row["tool_parser"] = self._parser
        return row
