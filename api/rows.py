"""The rows of a request checked against the deployment that is to run them.

Pure: no I/O, and the caller's rows are left as they were. The answer is new rows with each
`max_tokens` filled in from the deployment's default, so that what a route parsed stays what the
client sent. The token count against the model's context needs the tokenizer, which may have to
be read from disk: that check is the caller's (api/intake.py, through api/tokens.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sluice.api.errors import ApiError
from sluice.config.model import ModelConfig


class RowsRefused(ApiError):
    """A refusal that also says why in one word, for the rejection metric."""

    def __init__(self, status: int, message: str, *, reason: str, param: str) -> None:
        super().__init__(status, message, param=param)
        self.reason = reason


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


def checked_rows(model: ModelConfig, rows: Sequence[Mapping[str, Any]], *,
                 max_prompt_chars: int) -> list[dict[str, Any]]:
    """Copies of `rows` with `max_tokens` filled in; RowsRefused naming the problem otherwise."""
    if not rows:
        raise RowsRefused(400, "rows: at least one row is needed", reason="no_rows", param="rows")
    error = model.rows_error(len(rows))
    if error:
        raise RowsRefused(400, error, reason="batch_size", param="rows")
    limit = model.framework_config.max_model_len
    checked = []
    for i, row in enumerate(rows):
        if len(prompt_text(row)) > max_prompt_chars:
            raise RowsRefused(413, f"{where('prompt', i, len(rows))}: longer than {max_prompt_chars} characters",
                              reason="prompt_too_long", param="prompt")
        max_tokens = row.get("max_tokens") or model.default_max_tokens
        if limit is not None and max_tokens >= limit:
            raise RowsRefused(422, f"{where('max_tokens', i, len(rows))}: must be below the model's context "
                                   f"length ({limit})", reason="max_tokens", param="max_tokens")
        checked.append({**row, "max_tokens": max_tokens})
    return checked
