"""Arrow schemas of a model's input and output, written in YAML as name/type pairs."""

from __future__ import annotations

from typing import Literal

import pyarrow as pa
from pydantic import BaseModel, ConfigDict

ArrowType = Literal["string", "int64", "int32", "float64", "float32", "bool"]

_PA_TYPES = {
    "string": pa.string(),
    "int64": pa.int64(),
    "int32": pa.int32(),
    "float64": pa.float64(),
    "float32": pa.float32(),
    "bool": pa.bool_(),
}


class ArrowField(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    type: ArrowType
    nullable: bool = True


def to_arrow(fields: tuple[ArrowField, ...]) -> pa.Schema:
    return pa.schema([pa.field(f.name, _PA_TYPES[f.type], nullable=f.nullable) for f in fields])


DEFAULT_INPUT_SCHEMA: tuple[ArrowField, ...] = (
    ArrowField(name="prompt", type="string", nullable=False),
    ArrowField(name="max_tokens", type="int64"),
)
DEFAULT_OUTPUT_SCHEMA: tuple[ArrowField, ...] = (
    ArrowField(name="generated_text", type="string"),
    ArrowField(name="num_output_tokens", type="int64"),
)
