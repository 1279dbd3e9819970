"""What travels through Redis: request entries, reply events and status. JSON only, never pickle."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from sluice.protocol.states import State


class StructuredSpec(BaseModel):
    """Constrained decoding, as vLLM's StructuredOutputsParams: exactly one of these is set.

    `json_schema` is vLLM's `json` (a pydantic field may not be named `json`)."""

    model_config = ConfigDict(extra="ignore")

    json_schema: dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False


class SamplingExtras(BaseModel):
    """The sampling knobs, declared once: penalties and vLLM's sampling extras, each a keyword of
    vLLM's SamplingParams of the same name and meaning (0 / 1.0 / empty: off, as there), with its
    type, bounds and default. Every body takes them by inheriting this class (the native route's,
    OpenAI's completions and chat, where null stands for the default, and Responses, on the api
    and in a batch's lines), the queued entry's SamplingSpec carries them, and the worker hands
    them to its engine inside one object (GenerationRequest.sampling, a Sampled) that the vLLM
    engine passes through to SamplingParams: a knob added here needs no other change in the code
    (tests/workers/test_sampling_knobs.py), only its line in docs/openai.md."""

    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list, max_length=64)

    def extras(self) -> dict[str, Any]:
        """These fields as keywords."""
        return declared(self, SamplingExtras)


def declared(model: BaseModel, *parts: type[BaseModel]) -> dict[str, Any]:
    """`model`'s values of the fields that `parts`, sampling classes it inherits, declare: what
    a surface hands on by name, so that a field added to one of them goes along."""
    return {name: getattr(model, name) for part in parts for name in part.model_fields}


# The sampling core: temperature, top_p, stop, seed and the max_tokens bound, declared once
# with their bounds and defaults. A surface takes what it serves by inheriting the classes
# below: the native routes (SubmitRequest, the infer route's query), OpenAI's completions and
# chat (SamplingBody) and Responses (ResponseRequest), on the api and in a batch's lines; the
# api's Sampling and the queued SamplingSpec carry them, and the worker hands its engine a
# Sampled. A bound changed here is changed on every surface (tests/api/test_sampling_core.py).

MAX_TOKENS = 1_000_000  # the most tokens any request may ask for (protocol/rows.py checks each row)
MaxTokens = Annotated[int, Field(ge=1, le=MAX_TOKENS)]  # a max_tokens that its body bounds itself


class SamplingCore(BaseModel):
    """Temperature and top_p, with OpenAI's bounds and defaults: every surface takes them."""

    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)


class CallerSeed(BaseModel):
    """A caller's seed; None: admission draws one, so that every request has a seed to retry with."""

    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)


def stop_list(value: str | list[str] | None) -> list[str]:
    """One stop string or several (None: none) as a list, bounded as OpenAI bounds them."""
    stops = [value] if isinstance(value, str) else list(value or [])
    if len(stops) > 16:
        raise ValueError("at most 16 stop strings")
    if any(not s for s in stops):
        raise ValueError("stop strings must not be empty")
    return stops


# Typed as the wire takes it (the JSON schema, the messages of a wrong type); a list once validated.
Stops = Annotated[str | list[str] | None, AfterValidator(stop_list)]


class StopStrings(BaseModel):
    """Where the output ends (the native and OpenAI bodies'; not Responses', as OpenAI's)."""

    stop: Stops = Field(default=None, validate_default=True)  # an absent one too is [] once validated


class Sampled(StopStrings, SamplingCore, SamplingExtras):
    """How tokens are drawn, as a caller chose: what the engine is handed as one object."""

    def sampled(self, **changes: Any) -> Sampled:
        """These fields alone (of a body, or an entry's SamplingSpec), with `changes` made."""
        return Sampled.model_validate({**declared(self, Sampled), **changes})


class SamplingSpec(Sampled):
    """Sampling parameters fixed at admission; the seed makes a retried request repeat itself.

    Unknown fields are ignored: an api one version ahead of its workers (a rolling upgrade)
    may add one, and the older worker must still run the request.
    """

    model_config = ConfigDict(extra="ignore")

    max_tokens: int = Field(gt=0)
    # The seed admission chose: the caller's (CallerSeed) plus the request's index among its
    # call's choices, or one drawn; never None, and past the caller's bound by that index.
    seed: int
    # Log probabilities: of each generated token with this many alternatives, and of the
    # prompt's tokens (OpenAI's `echo` with `logprobs`); None: not returned.
    logprobs: int | None = Field(default=None, ge=0, le=20)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    structured: StructuredSpec | None = None


Lane = Literal["interactive", "bulk"]


class RequestMessage(BaseModel):
    """One stream entry: a request of one or more rows (unknown fields ignored, as above)."""

    model_config = ConfigDict(extra="ignore")

    id: str
    model: str
    rows: list[dict[str, Any]] = Field(min_length=1)
    sampling: SamplingSpec
    enqueued_at: float
    deadline: float
    priority: int = 0
    lane: Lane = "interactive"
    owner: str | None = None  # digest of the api key that made it; None without keys
    # The tenant of that key (config/tenants.py): fair share and quotas are per tenant.
    tenant: str = "default"
    # Chained hashes of the prompt's leading KV-cache blocks at a few depths, shallowest first
    # (protocol/prefix.py): requests sharing a prefix share their leading keys, and placement
    # prefers the worker likely to hold them. Empty: no affinity (nothing cacheable, not computed).
    prefix: list[str] = Field(default_factory=list, max_length=8)
    # The tokens `prefix` was computed from (its prompt's), for placement; 0: not counted.
    prefix_tokens: int = 0

    def to_fields(self) -> dict[str, str]:
        return {"id": self.id, "data": self.model_dump_json()}

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> RequestMessage:
        return cls.model_validate_json(fields["data"])


class TokenLogprob(BaseModel):
    """One token's log probability and the most likely alternatives at its position (rank
    order), as the engine reported them. `logprob` is None for a prompt's first token."""

    token: str
    logprob: float | None = None
    top: list[tuple[str, float]] = Field(default_factory=list)


class RowOutput(BaseModel):
    text: str
    num_output_tokens: int
    finish_reason: str | None = None
    fields: dict[str, Any] | None = None  # extra output fields of a custom runtime
    logprobs: list[TokenLogprob] | None = None  # one per output token, when asked for
    prompt_logprobs: list[TokenLogprob] | None = None  # one per prompt token, when asked for
    # Tool calls the deployment's tool-call parser found in the text (OpenAI's shape), and
    # the text around them; None when it found none or was not asked.
    tool_calls: list[dict[str, Any]] | None = None
    tool_content: str | None = None

    def record(self) -> dict[str, Any]:
        """The row in the default output schema, plus any extra fields."""
        return {"generated_text": self.text, "num_output_tokens": self.num_output_tokens,
                **(self.fields or {})}


class Timings(BaseModel):
    enqueued: float | None = None
    started: float | None = None
    first_token: float | None = None
    finished: float | None = None


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class FinalResult(BaseModel):
    """The last event of a reply stream, also kept in the status hash."""

    status: State
    output: RowOutput | None = None
    rows: list[RowOutput] | None = None  # multi-row requests: one output per input row
    error: str | None = None
    usage: Usage | None = None
    timings: Timings = Field(default_factory=Timings)
    attempt: int = 1


class DeltaEvent(BaseModel):
    """New tokens of one row. `i` is the index of the first token in the row's output."""

    i: int
    text: str
    token_ids: list[int]
    attempt: int = 1
    row: int = 0
    finish: str | None = None  # on the row's last delta: a retry resumes after it, not past it
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked for
    prompt_logprobs: list[TokenLogprob] | None = None  # on the row's first delta, when asked for
