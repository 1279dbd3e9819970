"""Batching configurations, with the names, defaults and messages of the product documents.

Each configuration states its own row rule (`rows_error`): the api refuses a request by it
before admission, and it travels with the configuration so the api needs no batching code.
Which policy runs each mode is batching/registry.py.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

CONTINUOUS_WITH_SINGLE = (
    "Continuous batching is not supported with single batch mode. "
    "Please update the model configuration."
)
DYNAMIC_WITH_SINGLE = (
    "Dynamic batching is not supported with single batch mode. "
    "Please update the model configuration."
)
CONTINUOUS_MULTI_ROW = (
    "Continuous batching is not supported with more than one batch at a time, "
    "please send requests with a single batch size"
)
MAX_BATCH_SIZE_EXCEEDED = "Maximum batch size exceeded, please configure a higher limit"
SINGLE_MULTI_ROW = (
    "Single batch mode accepts one row per request, please send requests with a single batch size"
)


class ContinuousBatchingConfig(BaseModel):
    """Up to `max_concurrent_batch_size` requests in flight in the engine at once."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_concurrent_batch_size: int = Field(default=256, gt=0)

    def rows_error(self, rows: int) -> str | None:
        """Each request holds one engine slot: a multi-row request would need several."""
        return CONTINUOUS_MULTI_ROW if rows > 1 else None


class DynamicBatchingConfig(BaseModel):
    """A batch is released at `batch_size_target` rows or after `max_batch_delay_ms`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_batch_delay_ms: int = Field(default=10, ge=0)
    batch_size_target: int = Field(default=4, gt=0)
    batch_size_limit: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _limit_not_below_target(self) -> DynamicBatchingConfig:
        if self.batch_size_limit is not None and self.batch_size_limit < self.batch_size_target:
            raise ValueError(
                f"batch_size_limit ({self.batch_size_limit}) must not be below "
                f"batch_size_target ({self.batch_size_target})"
            )
        return self

    def rows_error(self, rows: int) -> str | None:
        """A request is never split across batches, so it must fit the limit whole."""
        over = self.batch_size_limit is not None and rows > self.batch_size_limit
        return MAX_BATCH_SIZE_EXCEEDED if over else None


class SingleBatchConfig(BaseModel):
    """Single batch mode (`batch_config="single"`) has no options; this stands for it so that
    every mode has a configuration and a row rule."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def rows_error(self, rows: int) -> str | None:
        return SINGLE_MULTI_ROW if rows > 1 else None
