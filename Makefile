# The two commands of the quick start: `make up` and `make test`.
VENV ?= .venv

.PHONY: install up test bench

install:
	@bash scripts/install.sh

up: install
	$(VENV)/bin/sluice up

test: install
	$(VENV)/bin/python -m pytest

bench: install
	$(VENV)/bin/sluice bench throughput
	$(VENV)/bin/sluice bench startup
