# Tessera: `make dev` runs the platform, `make test` runs the tests. `make help` lists the rest.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

.PHONY: help dev test test-brokers lint services migrate clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | expand -t 12

# The runtime alone for running the platform, exactly as locked (requirements.lock, hashes checked: what the
# image installs), then the project; moto on top for `tessera dev`; the test extra (pytest, ruff, import-linter...)
# on top for testing and linting.
$(BIN)/.installed: pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --require-hashes -r requirements.lock
	$(BIN)/pip install -q --no-deps -e .
	touch $@

# `tessera dev` also runs moto's S3 server when TESSERA_S3_ENDPOINT_URL is unset: the dev extra.
$(BIN)/.installed-dev: $(BIN)/.installed
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

$(BIN)/.installed-test: $(BIN)/.installed
	$(BIN)/pip install -q -e ".[test]"
	touch $@

dev: $(BIN)/.installed-dev ## install the runtime and moto (the dev extra) into .venv and run `tessera dev` (embedded defaults unless TESSERA_* say otherwise)
	$(BIN)/tessera dev

test: $(BIN)/.installed-test services ## install with the test extra, make sure PostgreSQL, Redis, bubblewrap (and Chromium) are there, lint, check formatting, the layers and the types, run every test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy
	$(BIN)/pytest $(PYTEST_ARGS)

test-brokers: $(BIN)/.installed-test services ## the spine's tests and the kill tests again on RabbitMQ, the kill tests on a Redis behind a password, the spine's tests behind Redis Sentinel (scripts/brokers.sh)
	bash scripts/brokers.sh

lint: $(BIN)/.installed-test ## ruff (lint and format check), the import-linter contracts (layers only point down, no circles) and mypy
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy

services: ## start PostgreSQL and Redis on loopback when they are not running; install them, bubblewrap and Chromium if missing
	bash scripts/services.sh
	bash scripts/bubblewrap.sh
	bash scripts/chromium.sh

migrate: $(BIN)/.installed ## apply the migrations to the configured database
	$(BIN)/tessera migrate

clean: ## remove the virtual environment
	rm -rf $(VENV)
