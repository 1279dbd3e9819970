"""Structured-output requests checked before they are queued: a schema, regex or grammar the
decoding backend would refuse is the client's error (a 400 naming it), not a failed request
minutes later on a worker.

The check compiles the constraint with xgrammar, the backend vLLM picks for these on this
build, when it is installed (it comes with vLLM); without it, JSON schemas are checked
against their meta-schema and regexes with Python's `re`, and grammars are left to the engine.
"""

from __future__ import annotations

import json
import re

from sluice.protocol.messages import StructuredSpec


def problem(spec: StructuredSpec) -> str | None:
    """Why the engine could not decode with this constraint, or None."""
    try:
        import xgrammar
    except ImportError:  # an api installed without vLLM
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
