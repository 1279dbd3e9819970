"""OpenAI's Responses API over Sluice requests: the request body, the response object from a
request's status, and the stream of typed events with sequence numbers.

A response is one single-row chat request; its id is the request id's (`resp_<ms>-<hex>` for
`req-<ms>-<hex>`). The event sequence is a function of the reply stream alone (fixed events
around one `response.output_text.delta` per reply-stream delta), so a stream resumed with
`starting_after=N` is the same sequence from N + 1. Once the reply stream has expired, only
the status is left: a stream resumed after more events than can be rebuilt from it gets the
end events, with the whole text, numbered from N + 1 (EventSequence.end).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from sluice.protocol.messages import (
    CallerSeed,
    DeltaEvent,
    FinalResult,
    SamplingCore,
    SamplingExtras,
    StructuredSpec,
)
from sluice.protocol.states import State
from sluice.protocol.structured import problem as structured_problem

RESPONSE_PREFIX = "resp_"


def response_id(rid: str) -> str:
    return RESPONSE_PREFIX + rid.removeprefix("req-")


def request_id(response: str) -> str | None:
    """The request id behind a response id; None for an id of another form."""
    return "req-" + response.removeprefix(RESPONSE_PREFIX) if response.startswith(RESPONSE_PREFIX) else None


class InputText(BaseModel):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    def plain(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: TextFormat = Field(default_factory=TextFormat)


def bounded_metadata(metadata: dict[str, str]) -> dict[str, str]:
    """OpenAI's bounds on `metadata` (Responses, Batches): at most 16 keys of up to 64
    characters, values up to 512."""
    if len(metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in metadata.items()):
        raise ValueError("at most 16 keys of up to 64 characters, values up to 512")
    return metadata


class ResponseRequest(SamplingCore, CallerSeed, SamplingExtras):
    """POST /v1/responses, with vLLM's sampling extras as extra fields (as its server takes them).
    Fields this server does not serve are refused by name (problems())."""

    # temperature, top_p and seed come from their one declaration (protocol/messages.py); no
    # stop, as OpenAI's Responses.
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(default=None, max_length=128)
    input: str | list[InputMessage] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    text: TextOptions = Field(default_factory=TextOptions)
    stream: bool = False
    background: bool = False
    store: bool = True
    metadata: dict[str, str] = Field(default_factory=dict)
    tools: list[Any] | None = None
    previous_response_id: str | None = None
    conversation: Any = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, metadata: dict[str, str]) -> dict[str, str]:
        return bounded_metadata(metadata)

    def problems(self) -> list[tuple[str, str]]:
        unserved = ("tools", "previous_response_id", "conversation")
        out = [(name, f"{name}: not supported by this server") for name in unserved if getattr(self, name)]
        if self.background and not self.store:
            out.append(("store", "store: a background response must be stored"))
        try:
            self.structured()
        except ValueError as err:
            out.append(("text", str(err)))
        return out

    def messages(self) -> list[dict[str, str]]:
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else \
            [m.plain() for m in self.input]
        return ([{"role": "system", "content": self.instructions}] if self.instructions else []) + items

    def structured(self) -> StructuredSpec | None:
        fmt = self.text.format
        if fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredSpec(json_object=True)
        if fmt.schema_ is None:
            raise ValueError("text: format json_schema needs a schema")
        try:
            spec = StructuredSpec(json_schema=fmt.schema_)
        except ValidationError as err:
            raise ValueError(f"text: {err.errors()[0]['msg']}") from None
        why = structured_problem(spec)
        if why is not None:
            raise ValueError(f"text: the engine cannot decode with this schema: {why}")
        return spec

    def meta(self, created_at: int) -> dict[str, Any]:
        """What the response object repeats of the request (kept beside the request)."""
        return {"created_at": created_at, "instructions": self.instructions,
                "max_output_tokens": self.max_output_tokens, "temperature": self.temperature,
                "top_p": self.top_p,
                "text": {"format": self.text.format.model_dump(by_alias=True, exclude_none=True)},
                "background": self.background, "metadata": self.metadata}


_STATUS = {State.QUEUED: "queued", State.RUNNING: "in_progress", State.DONE: "completed",
           State.FAILED: "failed", State.EXPIRED: "failed", State.CANCELLED: "cancelled"}


def _message(rid: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": "msg_" + rid.removeprefix("req-"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text or
            status == "completed" else []}


def response_object(rid: str, model: str, meta: dict[str, Any], state: State,
                    final: FinalResult | None) -> dict[str, Any]:
    status, error, incomplete, output, usage = _STATUS[state], None, None, [], None
    if final is not None:
        status = _STATUS[final.status]
        text = final.output.text if final.output else ""
        if final.status is State.DONE and final.output and final.output.finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        if final.status in (State.FAILED, State.EXPIRED):
            error = {"code": "server_error" if final.status is State.FAILED else "expired",
                     "message": final.error or final.status.value}
        if text or final.status is State.DONE:
            output = [_message(rid, text, "completed" if status == "completed" else "incomplete")]
        if final.usage:
            u = final.usage
            usage = {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                     "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": u.prompt_tokens + u.completion_tokens}
    return {"id": response_id(rid), "object": "response", "created_at": meta["created_at"], "status": status,
            "background": meta["background"], "error": error, "incomplete_details": incomplete,
            "instructions": meta["instructions"], "max_output_tokens": meta["max_output_tokens"],
            "model": model,
            "output": output, "parallel_tool_calls": True, "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "store": True, "temperature": meta["temperature"],
            "text": meta["text"], "tool_choice": "auto", "tools": [], "top_p": meta["top_p"],
            "truncation": "disabled", "usage": usage, "metadata": meta["metadata"]}


class EventSequence:
    """The typed events of one response's stream, numbered from 0 in a fixed order: created,
    in_progress, the output item and its part added, a text delta per reply-stream delta, then
    the text, part and item done and the terminal event (completed, incomplete, failed or
    cancelled)."""

    def __init__(self, rid: str, model: str, meta: dict[str, Any]) -> None:
        self.rid, self.model, self.meta = rid, model, meta
        self.seq = 0
        self.text: list[str] = []
        self.item_id = "msg_" + rid.removeprefix("req-")

    def _event(self, kind: str, **fields: Any) -> tuple[int, dict[str, Any]]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event["sequence_number"], event

    def start(self) -> Iterator[tuple[int, dict[str, Any]]]:
        queued = response_object(self.rid, self.model, self.meta, State.QUEUED, None)
        yield self._event("response.created", response=queued)
        yield self._event("response.in_progress", response={**queued, "status": "in_progress"})
        yield self._event("response.output_item.added", output_index=0,
                          item={**_message(self.rid, "", "in_progress"), "content": []})
        yield self._event("response.content_part.added", item_id=self.item_id, output_index=0,
                          content_index=0,
                          part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})

    def delta(self, delta: DeltaEvent) -> Iterator[tuple[int, dict[str, Any]]]:
        self.text.append(delta.text)
        yield self._event("response.output_text.delta", item_id=self.item_id, output_index=0, content_index=0,
                          delta=delta.text, logprobs=[])

    def end(self, final: FinalResult, *,
            lost_after: int | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
        """The events after the last delta. `lost_after`: the reply stream expired before it
        was read to its end, and the client resumes after that sequence number. Past the
        events rebuilt so far, the numbering it saw cannot be rebuilt (nor the text it was
        shown): the end events, with the whole text, are numbered after it. A stream always
        ends."""
        done = response_object(self.rid, self.model, self.meta, final.status, final)
        text = final.output.text if final.output else "".join(self.text)
        if lost_after is not None and lost_after >= self.seq:
            self.seq = lost_after + 1
        elif len(text) > len("".join(self.text)):  # the reply stream expired: the rest in one piece
            yield from self.delta(DeltaEvent(i=0, text=text[len("".join(self.text)):], token_ids=[]))
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        yield self._event("response.output_text.done", item_id=self.item_id, output_index=0, content_index=0,
                          text=text, logprobs=[])
        yield self._event("response.content_part.done", item_id=self.item_id, output_index=0, content_index=0,
                          part=part)
        status = "completed" if done["status"] == "completed" else "incomplete"
        yield self._event("response.output_item.done", output_index=0, item=_message(self.rid, text, status))
        kind = {"completed": "response.completed", "incomplete": "response.incomplete",
                "cancelled": "response.cancelled"}.get(done["status"], "response.failed")
        yield self._event(kind, response=done)
