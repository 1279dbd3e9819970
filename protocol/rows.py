"""The checks a row passes before it is queued, whichever way it came: an api route, or a line
of a batch input file run by the jobs worker. Pure: no I/O, and the caller's rows are left as
they were. (The token count against the model's context needs the tokenizer: that check is
protocol/tokens.py's, made by the api and the jobs worker alike where they can read the
model's tokenizer; where it is not made, the worker's engine refuses the prompt.)"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sluice.config.model import ModelConfig
from sluice.protocol.messages import MAX_TOKENS


@dataclass(frozen=True)
class RowProblem:
    """Why a row is refused: the HTTP status a route answers, its message, one word for the
    rejection metric, and the parameter at fault."""

    status: int
    message: str
    reason: str
    param: str


def prompt_text(row: Mapping[str, Any]) -> str:
    """The text a row sends the model: its prompt, or its chat messages' contents (the chat
    template is applied by the worker's engine, so this is a lower bound of what it sees)."""
    prompt = row.get("prompt")
    if prompt:
        return str(prompt)
    messages = row.get("messages") or ()
    return "".join(str(m.get("content") or "") for m in messages if isinstance(m, Mapping))


def where(field: str, index: int, rows: int) -> str:
    """How an error names a field: bare for a one-row request, `rows[i].field` otherwise."""
    return field if rows == 1 else f"rows[{index}].{field}"


def unicode_problem(value: object) -> str | None:
    """Why `value` (a string, or lists and dicts of them) cannot be stored as UTF-8, or None.

    JSON may escape a lone surrogate ("\\ud800"); Python decodes it into a str that no UTF-8
    encoder accepts, so it would fail at the first Redis write or tokenizer call instead of here.
    """
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError as err:
            return f"not valid Unicode (a lone surrogate {value[err.start]!r} at position {err.start})"
        return None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return next((p for p in map(unicode_problem, items) if p), None)


def rows_problem(model: ModelConfig, rows: int) -> RowProblem | None:
    """Why a request of this many rows is refused by `model`'s deployment, if it is."""
    if not rows:
        return RowProblem(400, "rows: at least one row is needed", "no_rows", "rows")
    error = model.rows_error(rows)
    return RowProblem(400, error, "batch_size", "rows") if error else None


def row_problem(model: ModelConfig, row: Mapping[str, Any], index: int = 0, rows: int = 1, *,
                max_prompt_chars: int) -> RowProblem | None:
    """Why row `index` of `rows` cannot run on `model`, or None; `max_tokens` None stands for the
    deployment's default (as the row will be queued)."""
    if len(prompt_text(row)) > max_prompt_chars:
        return RowProblem(413, f"{where('prompt', index, rows)}: longer than {max_prompt_chars} characters",
                          "prompt_too_long", "prompt")
    max_tokens = row.get("max_tokens") or model.default_max_tokens
    too_many = max_tokens_problem(max_tokens, where("max_tokens", index, rows))
    if too_many:
        return too_many
    limit = model.framework_config.max_model_len
    if limit is not None and max_tokens >= limit:
        return RowProblem(422, f"{where('max_tokens', index, rows)}: must be below the model's context "
                               f"length ({limit})", "max_tokens", "max_tokens")
    return None


def max_tokens_problem(max_tokens: int, field: str = "max_tokens") -> RowProblem | None:
    """The bound on max_tokens (MAX_TOKENS) where a body does not hold it itself: a 422 naming
    `field`, the same from every route and for a batch's line."""
    if max_tokens > MAX_TOKENS:
        return RowProblem(422, f"{field}: at most {MAX_TOKENS}", "max_tokens", "max_tokens")
    return None


INT32_MAX = 2**31 - 1  # the engine's sampling fields are 32-bit


def sampling_problem(model: ModelConfig, sampling: Mapping[str, Any], max_tokens: int,
                     vocab: int | None) -> RowProblem | None:
    """Why the engine would refuse these sampling values, or None: a top_k past its 32-bit field,
    stop_token_ids outside the model's vocabulary (`vocab`, where its tokenizer can be read),
    min_tokens over max_tokens. The api's routes answer the same 400s (api/intake.py)."""
    top_k = sampling.get("top_k") or 0
    if top_k > INT32_MAX:
        return RowProblem(400, f"top_k: at most {INT32_MAX} (-1 or 0: every token)", "top_k", "top_k")
    bound = vocab if vocab is not None else INT32_MAX + 1
    bad = next((t for t in sampling.get("stop_token_ids") or () if not 0 <= t < bound), None)
    if bad is not None:
        return RowProblem(400, f"stop_token_ids: {bad} is not a token id of model {model.name!r} "
                               f"(0 to {bound - 1})", "stop_token_ids", "stop_token_ids")
    min_tokens = sampling.get("min_tokens") or 0
    if min_tokens > max_tokens:
        return RowProblem(400, f"min_tokens: {min_tokens} is more than max_tokens ({max_tokens})",
                          "min_tokens", "min_tokens")
    return None
