"""The batching mode table: every mode a deployment can name resolves to its configuration,
row rule and policy; an unknown mode is a clear error."""

from __future__ import annotations

import pytest

from sluice.batching.continuous import ContinuousAdmission
from sluice.batching.dynamic import DynamicBatcher
from sluice.batching.registry import MODES, UnknownBatchingMode, batching_mode, make_policy
from sluice.batching.single import SingleBatcher
from sluice.config.batching import ContinuousBatchingConfig, DynamicBatchingConfig
from sluice.config.model import BatchMode, ModelConfig

DEPLOYMENTS = {
    BatchMode.CONTINUOUS: [ModelConfig(name="c"),
                           ModelConfig(name="c", continuous_batching_config=ContinuousBatchingConfig(
                               max_concurrent_batch_size=3))],
    BatchMode.DYNAMIC: [ModelConfig(name="d", dynamic_batching_config=DynamicBatchingConfig()),
                        ModelConfig(name="d", dynamic_batching_config=DynamicBatchingConfig(
                            batch_size_target=2, batch_size_limit=3))],
    BatchMode.SINGLE: [ModelConfig(name="s", batch_config="single")],
}


def test_every_configurable_mode_has_an_entry_and_nothing_else_does() -> None:
    assert set(MODES) == {m.value for m in BatchMode} == {m.value for m in DEPLOYMENTS}


@pytest.mark.parametrize("mode", list(BatchMode))
def test_every_mode_resolves_to_its_policy(mode: BatchMode) -> None:
    kinds = {BatchMode.CONTINUOUS: ContinuousAdmission, BatchMode.DYNAMIC: DynamicBatcher,
             BatchMode.SINGLE: SingleBatcher}
    for model in DEPLOYMENTS[mode]:
        entry = batching_mode(model.mode.value)
        assert entry.name == mode.value
        assert isinstance(entry.config_of(model), entry.config)
        policy = make_policy(model)
        assert type(policy) is kinds[mode]
        assert make_policy(model) is not policy  # fresh each time: a policy runs one configuration


def test_policies_take_the_deployment_options() -> None:
    assert make_policy(DEPLOYMENTS[BatchMode.CONTINUOUS][0]).capacity == 256  # the default options
    assert make_policy(DEPLOYMENTS[BatchMode.CONTINUOUS][1]).capacity == 3
    assert make_policy(DEPLOYMENTS[BatchMode.DYNAMIC][0]).capacity == 4  # no limit: the target
    assert make_policy(DEPLOYMENTS[BatchMode.DYNAMIC][1]).capacity == 3
    assert make_policy(DEPLOYMENTS[BatchMode.SINGLE][0]).capacity == 1


@pytest.mark.parametrize("mode", list(BatchMode))
def test_the_row_rule_of_each_mode_is_the_one_the_api_applies(mode: BatchMode) -> None:
    for model in DEPLOYMENTS[mode]:
        entry = batching_mode(mode.value)
        for rows in range(1, 6):
            assert entry.rows_error(model, rows) == model.rows_error(rows), (model, rows)


def test_row_rules_refuse_with_the_documented_messages() -> None:
    cont, dyn, single = (DEPLOYMENTS[m][-1] for m in BatchMode)
    assert batching_mode("continuous").rows_error(cont, 1) is None
    assert batching_mode("continuous").rows_error(cont, 2).startswith("Continuous batching is not supported")
    assert batching_mode("dynamic").rows_error(dyn, 3) is None
    assert batching_mode("dynamic").rows_error(dyn, 4) == "Maximum batch size exceeded, please configure a higher limit"
    assert batching_mode("single").rows_error(single, 2).startswith("Single batch mode accepts one row")


@pytest.mark.parametrize("name", ["", "Dynamic", "streaming", "continuous "])
def test_an_unknown_mode_is_a_clear_error(name: str) -> None:
    with pytest.raises(UnknownBatchingMode) as err:
        batching_mode(name)
    assert repr(name) in str(err.value)
    assert "continuous, dynamic, single" in str(err.value)
    assert isinstance(err.value, ValueError)
