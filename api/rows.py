"""The rows of a request checked against the deployment that is to run them.

Pure: no I/O, and the caller's rows are left as they were. The answer is new rows with each
`max_tokens` filled in from the deployment's default, so that what a route parsed stays what the
client sent. The token count against the model's context needs the tokenizer, which may have to
be read from disk: that check is the caller's (api/intake.py, through protocol/tokens.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sluice.api.errors import ApiError
from sluice.config.model import ModelConfig
from sluice.protocol.rows import prompt_text, row_problem, rows_problem, where

__all__ = ["RowsRefused", "checked_rows", "prompt_text", "where"]  # the checks live in protocol/rows.py


class RowsRefused(ApiError):
    """A refusal that also says why in one word, for the rejection metric."""

    def __init__(self, status: int, message: str, *, reason: str, param: str) -> None:
        super().__init__(status, message, param=param)
        self.reason = reason


def checked_rows(model: ModelConfig, rows: Sequence[Mapping[str, Any]], *,
                 max_prompt_chars: int) -> list[dict[str, Any]]:
    """Copies of `rows` with `max_tokens` filled in; RowsRefused naming the problem otherwise."""
    problems = [rows_problem(model, len(rows))]
    problems += [row_problem(model, row, i, len(rows), max_prompt_chars=max_prompt_chars)
                 for i, row in enumerate(rows)]
    problem = next((p for p in problems if p), None)
    if problem:
        raise RowsRefused(problem.status, problem.message, reason=problem.reason, param=problem.param)
    return [{**row, "max_tokens": row.get("max_tokens") or model.default_max_tokens} for row in rows]
