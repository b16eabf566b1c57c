# Two entry points for a fresh Debian machine: `make demo` and `make test`. Both run `setup`,
# which is idempotent: system packages only when missing, the venv only when out of date.
SHELL := /bin/bash
# The system Python when there is one (Debian 12: 3.11.2): a venv made from it can be run by
# every user of the node, which a venv of an interpreter in someone's home (pyenv) cannot.
PYTHON ?= $(shell test -x /usr/bin/python3 && echo /usr/bin/python3 || echo python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.fanfs-installed
PYTEST_ARGS ?=
# Setup's own output (apt, pip, the pyfuse3 build) goes here, not to the terminal: it is shown
# only when a step fails (tools/quietly.sh).
SETUP_LOG := .setup.log
QUIET := bash tools/quietly.sh $(SETUP_LOG)

export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

.PHONY: setup system demo test test-pythons lint clean

setup: system $(STAMP)

system:
	@$(QUIET) env PYTHON=$(PYTHON) bash tools/setup_system.sh

# fanfs/node/fuse_ops.py holds the pyfuse3 patch level: a new level rebuilds pyfuse3. The
# extension (fanfs._native) is rebuilt by the editable install when its C or Cython changes.
$(STAMP): pyproject.toml setup.py tools/install_pyfuse3.py fanfs/node/fuse_ops.py \
		fanfs/_native.pyx $(wildcard fanfs/csrc/*) $(wildcard tools/pyfuse3_patch/*)
	@echo "fanfs setup: making $(VENV) (a few minutes the first time; log in $(SETUP_LOG))"
	@test -x $(BIN)/python || $(QUIET) $(PYTHON) -m venv $(VENV)
	@$(QUIET) $(BIN)/python -m pip install --upgrade pip setuptools wheel
	@$(QUIET) $(BIN)/python tools/install_pyfuse3.py
	@$(QUIET) $(BIN)/python -m pip install -e '.[test]'
	@touch $(STAMP)
	@echo "fanfs setup: ready ($(BIN)/fanfs)"

demo: setup
	$(BIN)/python tools/demo.py

lint: setup
	$(BIN)/ruff check fanfs tools tests
	$(BIN)/ruff format --check fanfs tools tests
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)
	bash tools/test_pythons.sh

# The unit and adapter tiers under the other Pythons pyproject.toml claims (part of `test`).
test-pythons: system
	bash tools/test_pythons.sh

clean:
	rm -rf $(VENV) .venv-3.* build *.egg-info $(SETUP_LOG)
