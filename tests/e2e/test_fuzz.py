"""Fuzz the OpenAPI spec (schemathesis) against a real api + null-engine worker: no 5xx, ever."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from tests.e2e.conftest import null_stack

MODELS = """
models:
  - name: fuzz
    framework_config: {max_model_len: 2048}
    dynamic_batching_config: {max_batch_delay_ms: 5, batch_size_target: 4, batch_size_limit: 8}
"""


@pytest.fixture(scope="module")
def fuzz_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with null_stack(tmp_path_factory.mktemp("fuzz"), MODELS, "fuzz", SLUICE_MAX_WAIT_S="1",
                    SLUICE_REQUEST_TIMEOUT_S="5") as stack:
        yield stack.url


def test_no_server_errors(fuzz_api: str) -> None:
    # Driven by hand rather than with schemathesis's pytest plugin, which does not load under
    # this pytest: every operation of the spec, each with generated valid and invalid input.
    schema = schemathesis.openapi.from_url(f"{fuzz_api}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8
    failures: list[str] = []
    calls: list[int] = []
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case) -> None:
            calls.append(case.call_and_validate(checks=[not_a_server_error], timeout=30).status_code)

        try:
            check()
        except Exception as err:  # collect every operation's failure, not just the first
            failures.append(f"{operation.label}: {err}")
    assert not failures, "\n\n".join(failures)
    assert len(calls) >= 10 * len(operations)
    assert any(400 <= code < 500 for code in calls) and any(code < 300 for code in calls)
