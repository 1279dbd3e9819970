# The two commands of the quick start: `make up` and `make test`.
VENV ?= .venv

.PHONY: install up test coverage bench

install:
	@bash scripts/install.sh

up: install
	$(VENV)/bin/sluice up

# Then the broker, api, worker and fault tests again against a local Redis Cluster (3 + 3 nodes).
test: install
	@bash scripts/test-deps.sh
	$(VENV)/bin/python scripts/typecheck.py
	$(VENV)/bin/python -m pytest --durations=20
	SLUICE_TEST_REDIS=cluster $(VENV)/bin/python -m pytest --durations=10 -n 2 tests/broker tests/api tests/workers \
		tests/faults/test_faults.py tests/faults/test_delivery_modes.py

# The suite under coverage (api and worker processes included), then the line report.
coverage: install
	rm -rf .coverage-data && mkdir -p .coverage-data
	$(VENV)/bin/python -m coverage run -m pytest
	$(VENV)/bin/python -m coverage combine -q
	$(VENV)/bin/python -m coverage report --sort=cover

bench: install
	$(VENV)/bin/sluice bench throughput
	$(VENV)/bin/sluice bench startup
