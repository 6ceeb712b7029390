# The two quick-start commands are `make demo` and `make test`; the rest is plumbing they share.
# Both create .venv if absent, install torch if missing, build the extension (incrementally: no
# rebuild when nothing under csrc/, cmake/ or the build files changed) and then run.
#
# Which torch: an existing torch in .venv is always kept. Otherwise, with an NVIDIA GPU visible
# (`nvidia-smi -L` succeeds) torch==$(TORCH_VERSION) is installed as published (the CUDA build);
# without one, the CPU build torch==$(TORCH_VERSION)+cpu is installed, taken from wherever pip finds
# it (a local wheel directory, or PyTorch's CPU index passed via TORCH_PIP_ARGS). If no CPU build is
# reachable, the default build is installed instead (it runs on CPU too, it is only larger).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
TORCH_PIP_ARGS ?=
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
BUILT := $(VENV)/.asyncpp-built
SOURCES := $(shell find csrc cmake -type f 2>/dev/null) CMakeLists.txt setup.py pyproject.toml

.PHONY: demo test build clean gpu-check
.DELETE_ON_ERROR:

demo: $(BUILT)
	$(PY) -m asyncpp_ext.training.demo

test: $(BUILT)
	$(PY) -m pytest

build: $(BUILT)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch: | $(PY)
	@if $(PY) -c "import torch" 2>/dev/null; then \
	  echo "torch $$($(PY) -c 'import torch; print(torch.__version__)') already installed"; \
	elif nvidia-smi -L >/dev/null 2>&1; then \
	  echo "NVIDIA GPU found: installing torch==$(TORCH_VERSION)"; \
	  $(PIP) install -q "torch==$(TORCH_VERSION)" $(TORCH_PIP_ARGS); \
	else \
	  echo "no NVIDIA GPU: installing the CPU build torch==$(TORCH_VERSION)+cpu"; \
	  $(PIP) install -q "torch==$(TORCH_VERSION)+cpu" $(TORCH_PIP_ARGS) || { \
	    echo "CPU build not reachable (set TORCH_PIP_ARGS='--index-url <PyTorch CPU index>');" \
	         "installing the default torch==$(TORCH_VERSION)"; \
	    $(PIP) install -q "torch==$(TORCH_VERSION)" $(TORCH_PIP_ARGS); }; \
	fi
	@touch $@

# Build requirements, the same list as pyproject.toml [build-system].requires: installed once so
# that re-builds can skip build isolation and stay incremental.
$(VENV)/.build-deps: pyproject.toml | $(PY)
	$(PIP) install -q "setuptools>=77" wheel "pybind11>=2.12" "cmake>=3.26" ninja
	@touch $@

$(BUILT): $(SOURCES) $(VENV)/.torch $(VENV)/.build-deps
	$(PIP) install -q --no-build-isolation -e ".[test]"
	@touch $@

clean:
	rm -rf build asyncpp_ext/_C*.so asyncpp_ext.egg-info

# The GPU proof kit on THIS interpreter's torch: builds in place against the installed torch,
# pybind11, cmake and ninja (never downloads: --no-index, --no-deps, no build isolation), then
# writes gpu_check/report.md and report.json. GPU_CHECK_ARGS=--quick for a shorter run.
GPU_CHECK_ARGS ?=
gpu-check:
	$(PYTHON) -m pip install --disable-pip-version-check --no-index --no-build-isolation --no-deps -e .
	$(PYTHON) -m asyncpp_ext.gpu_check --out gpu_check $(GPU_CHECK_ARGS)
