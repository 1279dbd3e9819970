"""Model deployments: what a model is, how its engine starts and how its requests are batched."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, model_validator

from sluice.config.batching import (
    CONTINUOUS_WITH_SINGLE,
    DYNAMIC_WITH_SINGLE,
    ContinuousBatchingConfig,
    DynamicBatchingConfig,
    SingleBatchConfig,
)
from sluice.config.deployment import DeploymentConfig, SLOConfig
from sluice.config.engine import VLLMConfig
from sluice.config.schema import DEFAULT_INPUT_SCHEMA, DEFAULT_OUTPUT_SCHEMA, ArrowField

# `path` value naming the default model that `sluice models prepare` builds.
DEFAULT_MODEL_PATH = "builtin:smollm2-135m-instruct"

SHIPPED_MODELS_FILE = Path(__file__).with_name("models.yaml")


class ConfigError(ValueError):
    """A deployment file or value that cannot be loaded; the message names the field."""


class BatchMode(str, enum.Enum):
    CONTINUOUS = "continuous"
    DYNAMIC = "dynamic"
    SINGLE = "single"


class ModelConfig(BaseModel):
    """One model deployment. Exactly one batching mode; continuous (defaults) when none is set."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
    version: int = Field(default=1, ge=1)
    framework: Literal["vllm", "custom"] = "vllm"
    path: str = DEFAULT_MODEL_PATH
    runtime: str | None = Field(default=None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    input_schema: tuple[ArrowField, ...] = DEFAULT_INPUT_SCHEMA
    output_schema: tuple[ArrowField, ...] = DEFAULT_OUTPUT_SCHEMA
    framework_config: VLLMConfig = Field(
        default_factory=VLLMConfig, validation_alias=AliasChoices("framework_config", "vllm_config")
    )
    continuous_batching_config: ContinuousBatchingConfig | None = None
    dynamic_batching_config: DynamicBatchingConfig | None = None
    batch_config: Literal["single"] | None = None
    # Per-model overrides of the settings of the same names.
    max_queued: int | None = Field(default=None, gt=0)
    request_timeout_s: float | None = Field(default=None, gt=0)
    max_deliveries: int | None = Field(default=None, gt=0)
    result_ttl_s: int | None = Field(default=None, gt=0)  # how long a finished request's result is kept
    default_max_tokens: int = Field(default=256, gt=0)
    # One of vLLM's tool-call parsers (`hermes`, `llama3_json`, ...): chat requests with
    # `tool_choice: "auto"` are then answered with the calls it finds in the output.
    tool_call_parser: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    # Replicas and what each gets: read by `sluice up`, `sluice compose` and `sluice publish`;
    # not part of the stored deployment (scaling is not a new version).
    deployment: DeploymentConfig = Field(default_factory=DeploymentConfig)
    # Latency targets: admission holds to them instead of serving every request late.
    slo: SLOConfig | None = None
    # A hot model's interactive stream split over this many streams, each its own cluster slot
    # ({m:<model>:<k>}): the api spreads requests over them, workers read them all.
    shards: int = Field(default=1, ge=1, le=64)
    # Prefix affinity: the api gives each request its prefix key (protocol/prefix.py) and workers
    # prefer the waiting requests whose prefix their engine's cache likely holds, within a bound
    # of extra wait (docs/prefix-affinity.md); false: no keys, plain FIFO pulls.
    prefix_affinity: bool = True

    @model_validator(mode="after")
    def _one_batching_mode(self) -> ModelConfig:
        if self.batch_config == "single":
            if self.continuous_batching_config is not None:
                raise ValueError(CONTINUOUS_WITH_SINGLE)
            if self.dynamic_batching_config is not None:
                raise ValueError(DYNAMIC_WITH_SINGLE)
        if self.continuous_batching_config is not None and self.dynamic_batching_config is not None:
            raise ValueError(
                "continuous_batching_config and dynamic_batching_config are exclusive: set one"
            )
        if self.framework == "custom" and self.runtime is None:
            raise ValueError("runtime: a custom framework needs runtime: 'module:Class'")
        if self.framework == "vllm" and self.runtime is not None:
            raise ValueError("runtime: only a custom framework takes a runtime class")
        return self

    @property
    def mode(self) -> BatchMode:
        if self.batch_config == "single":
            return BatchMode.SINGLE
        if self.dynamic_batching_config is not None:
            return BatchMode.DYNAMIC
        return BatchMode.CONTINUOUS

    @property
    def continuous(self) -> ContinuousBatchingConfig:
        return self.continuous_batching_config or ContinuousBatchingConfig()

    @property
    def batching(self) -> ContinuousBatchingConfig | DynamicBatchingConfig | SingleBatchConfig:
        """The options of this deployment's batching mode (each carries the mode's row rule)."""
        if self.mode is BatchMode.SINGLE:
            return SingleBatchConfig()
        return self.dynamic_batching_config or self.continuous

    def rows_error(self, rows: int) -> str | None:
        """Why a request of this many rows is refused by this deployment's batching mode, if it is."""
        return self.batching.rows_error(rows)

    def deployment_key(self) -> dict[str, Any]:
        """What makes two deployments the same (everything but the version)."""
        return self.model_dump(mode="json", exclude={"version", "deployment"})


def _format_error(err: ValidationError, prefix: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in (prefix, *e["loc"]) if p != "")
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"{loc}: {msg}")
    return "; ".join(lines)


def parse_model(data: Any, where: str = "") -> ModelConfig:
    try:
        return ModelConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err, where)) from None


def load_models(path: Path | None = None) -> list[ModelConfig]:
    """Load deployments from a YAML file: `models: [ {name: ..., ...}, ... ]`."""
    path = path or SHIPPED_MODELS_FILE
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"{path}: {err}") from None
    if not isinstance(data, dict) or not isinstance(data.get("models"), list) or not data["models"]:
        raise ConfigError(f"{path}: models: expected a non-empty list of model deployments")
    models = [parse_model(m, f"{path}: models[{i}]") for i, m in enumerate(data["models"])]
    names = [m.name for m in models]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"{path}: models: duplicate name(s) {', '.join(dupes)}")
    return models
