# One command each: `make run` (set up, then the daemon in the foreground) and
# `make test` (set up, then the whole suite). Everything is installed here.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# A CPU build of torch; an unpinned torch pulls a multi-GB CUDA build.
TORCH  ?= torch==2.13.*

.PHONY: venv run test check lint typecheck demo bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml client/pyproject.toml client/setup.py client/kvd_client/_blockcopy.c Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ./client -e ".[dev]"
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvd serve

test: $(STAMP)
	$(PY) -m pytest -q tests

lint: $(STAMP)
	$(VENV)/bin/ruff check kvd client tests
	$(VENV)/bin/ruff format --check kvd client tests

typecheck: $(STAMP)
	$(VENV)/bin/mypy kvd client/kvd_client

check: lint typecheck
	$(PY) -m pytest -q -W error tests

demo: $(STAMP)
	$(VENV)/bin/kvd demo

bench: $(STAMP)
	$(VENV)/bin/kvd bench all --json bench.json

clean:
	rm -rf $(VENV) build *.egg-info client/*.egg-info .pytest_cache .mypy_cache .ruff_cache
