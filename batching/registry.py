"""The batching modes, in one table: a mode's name, its configuration class (which carries the
mode's row rule) and the policy that runs it.

Adding a mode is its policy module and one entry here (and its configuration class, when it
has options). Everything that chooses by mode (the worker building its policy, tests that
cover every mode) reads this table instead of matching on mode names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from sluice.batching.base import BatchingPolicy
from sluice.batching.continuous import ContinuousAdmission
from sluice.batching.dynamic import DynamicBatcher
from sluice.batching.single import SingleBatcher
from sluice.config.batching import ContinuousBatchingConfig, DynamicBatchingConfig, SingleBatchConfig
from sluice.config.model import ModelConfig


class ModeConfig(Protocol):
    def rows_error(self, rows: int) -> str | None: ...


class UnknownBatchingMode(ValueError):
    """A mode name no entry of the table has: a deployment from a newer Sluice, or a typo."""


@dataclass(frozen=True)
class BatchingMode:
    name: str
    config: type[ModeConfig]  # its options (a pydantic model); defaults when the deployment sets none
    field: str | None  # where a ModelConfig holds them (None: the mode has no options to set)
    policy: Callable[[Any], BatchingPolicy[Any]]  # a fresh policy from the options

    def config_of(self, model: ModelConfig) -> ModeConfig:
        value = getattr(model, self.field) if self.field else None
        return value if value is not None else self.config()

    def rows_error(self, model: ModelConfig, rows: int) -> str | None:
        """Why this mode refuses a request of this many rows, if it does."""
        return self.config_of(model).rows_error(rows)

    def make_policy(self, model: ModelConfig) -> BatchingPolicy[Any]:
        return self.policy(self.config_of(model))


MODES: dict[str, BatchingMode] = {m.name: m for m in (
    BatchingMode("continuous", ContinuousBatchingConfig, "continuous_batching_config", ContinuousAdmission),
    BatchingMode("dynamic", DynamicBatchingConfig, "dynamic_batching_config", DynamicBatcher),
    BatchingMode("single", SingleBatchConfig, None, lambda _: SingleBatcher()),
)}


def batching_mode(name: str) -> BatchingMode:
    try:
        return MODES[name]
    except KeyError:
        raise UnknownBatchingMode(
            f"unknown batching mode {name!r}: this Sluice knows {', '.join(sorted(MODES))}") from None


def make_policy(model: ModelConfig) -> BatchingPolicy[Any]:
    """The batching policy a deployment asks for, fresh (a policy runs one configuration)."""
    return batching_mode(model.mode.value).make_policy(model)
