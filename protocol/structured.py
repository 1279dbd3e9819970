"""Structured-output requests read from their fields (OpenAI's `response_format`, vLLM's
`structured_outputs`) and checked before they are queued: a schema, regex or grammar the
decoding backend would refuse is the client's error (a 400 naming it), not a failed request
minutes later on a worker.

The check compiles the constraint with xgrammar, the backend vLLM picks for these on this
build, when it is installed (it comes with vLLM); without it, JSON schemas are checked
against their meta-schema and regexes with Python's `re`, and grammars are left to the engine.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from pydantic import ValidationError

from sluice.protocol.messages import StructuredSpec


def problem(spec: StructuredSpec) -> str | None:
    """Why the engine could not decode with this constraint, or None. Compiled once per
    process for each distinct constraint (clients tend to send the same schema every time);
    the api calls it off its event loop (a compile can take a while)."""
    return _problem(spec.model_dump_json())


@functools.cache
def backend() -> Any:
    """xgrammar, or None where it is not installed (an api without vLLM). Its first import takes
    seconds: the api begins it at start in a thread (api/app.py), never on its event loop."""
    try:
        import xgrammar
    except ImportError:
        return None
    return xgrammar


@functools.lru_cache(maxsize=256)
def _problem(spec_json: str) -> str | None:
    spec = StructuredSpec.model_validate_json(spec_json)
    xgrammar = backend()
    if xgrammar is None:
        return _fallback(spec)
    try:
        if spec.json_schema is not None:
            xgrammar.Grammar.from_json_schema(json.dumps(spec.json_schema))
        elif spec.regex is not None:
            xgrammar.Grammar.from_regex(spec.regex)
        elif spec.grammar is not None:
            xgrammar.Grammar.from_ebnf(spec.grammar)
    except (RuntimeError, ValueError) as err:
        # xgrammar's messages start with a timestamp and a source file: keep what follows.
        return str(err).strip().split(": ", 1)[-1].splitlines()[0]
    return None


def _fallback(spec: StructuredSpec) -> str | None:
    if spec.json_schema is not None:
        try:
            from jsonschema.exceptions import SchemaError
            from jsonschema.validators import validator_for
        except ImportError:
            return None
        try:
            validator_for(spec.json_schema).check_schema(spec.json_schema)
        except SchemaError as err:
            return err.message
    if spec.regex is not None:
        try:
            re.compile(spec.regex)
        except re.error as err:
            return str(err)
    return None


def from_fields(param: str, fields: dict[str, Any]) -> StructuredSpec:
    """The one constraint of a request's fields (StructuredSpec's names); ValueError("param: why")."""
    if len(fields) != 1:
        raise ValueError(f"{param}: exactly one of json, regex, choice, grammar, json_object")
    try:
        spec = StructuredSpec.model_validate(fields)
    except ValidationError as err:
        raise ValueError(f"{param}: {err.errors()[0]['msg']}") from None
    if spec.json_schema is not None and not isinstance(fields.get("json_schema"), dict):
        raise ValueError(f"{param}: a JSON schema must be an object")
    if spec.choice is not None and (not spec.choice or any(not c for c in spec.choice)):
        raise ValueError(f"{param}: choice must be a non-empty list of non-empty strings")
    return spec


def from_response_format(rf: dict[str, Any]) -> StructuredSpec | None:
    """OpenAI's `response_format` as a constraint (None for text); ValueError("response_format: why")."""
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec(json_object=True)
    if kind == "json_schema":
        schema = (rf.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise ValueError("response_format: json_schema.schema must be a JSON schema object")
        return StructuredSpec(json_schema=schema)
    raise ValueError(f"response_format: type {kind!r} is not one of text, json_object, json_schema")
