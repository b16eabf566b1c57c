# Two entry points for a fresh Debian machine: `make demo` and `make test`. Both run `setup`,
# which is idempotent: system packages only when missing, the venv only when out of date.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.fanfs-installed
PYTEST_ARGS ?=

export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

.PHONY: setup system demo test lint clean

setup: system $(STAMP)

system:
	@bash tools/setup_system.sh

$(STAMP): pyproject.toml tools/install_pyfuse3.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel
	$(BIN)/python tools/install_pyfuse3.py
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: setup
	$(BIN)/python tools/demo.py

lint: setup
	$(BIN)/ruff check fanfs tools tests
	$(BIN)/ruff format --check fanfs tools tests
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
