"""Tools on chat completions, answered as vLLM answers them without a tool-call parser: the
output is constrained to the function's parameters schema (a named `tool_choice`) or to a
list of calls to any of the tools (`"required"`), and read back as `tool_calls`."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Tool modes besides a named function; function names cannot contain "<".
REQUIRED, AUTO = "<required>", "<auto>"


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: ToolFunction


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


def tool_calls_schema(tools: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A JSON array of one or more calls, each `{"name": ..., "parameters": {...}}` naming one
    of the tools with arguments valid for it (vLLM's schema for `tool_choice: "required"`)."""
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
              "required": ["name", "parameters"]} for name, params in tools.items()]
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}


def _call_id(rid: str, k: int) -> str:
    """Stable per request and call: a batch run again, or a stream resumed, names the same calls."""
    return "call_" + hashlib.sha256(f"{rid}:{k}".encode()).hexdigest()[:24]


def tool_calls(mode: str, text: str, rid: str) -> list[dict[str, Any]] | None:
    """The output as OpenAI's `tool_calls`, or None when it is not a complete call (cut short
    by max_tokens): the text is then returned as content."""
    try:
        parsed = json.loads(text)
    except ValueError:
        return None
    if mode == REQUIRED:
        if not isinstance(parsed, list) or not all(isinstance(c, dict) and "name" in c for c in parsed):
            return None
        calls = [(c["name"], json.dumps(c.get("parameters", {}))) for c in parsed]
    elif isinstance(parsed, dict):
        calls = [(mode, text)]  # the arguments as generated
    else:
        return None
    return [{"id": _call_id(rid, k), "type": "function", "function": {"name": name, "arguments": args}}
            for k, (name, args) in enumerate(calls)]
