# The two quick-start commands are `make demo` and `make test`; the rest is plumbing they share.
# Both create .venv if absent, install torch if missing, build the extension (incrementally: no
# rebuild when nothing under csrc/, cmake/ or the build files changed) and then run.
#
# Which torch: an existing torch in .venv is always kept. If $(PYTHON) (python3 unless given)
# imports torch already -- a GPU machine's system or container Python, a cluster module, another
# venv -- .venv is created seeing that interpreter's site packages (a .pth file that adds them
# after .venv's own), so that torch, the build requirements and anything else already there are
# used as they are: nothing is downloaded that is not missing. Otherwise, with an NVIDIA GPU
# visible (`nvidia-smi -L` succeeds) torch==$(TORCH_VERSION) is installed as published (the CUDA
# build); without one, the CPU build torch==$(TORCH_VERSION)+cpu is installed, taken from wherever
# pip finds it (a local wheel directory, or PyTorch's CPU index passed via TORCH_PIP_ARGS). If no
# CPU build is reachable, the default build is installed instead (it runs on CPU too, it is only
# larger). Every other requirement is installed only when missing; where no package index is
# reachable, a missing one stops the build with one line naming it (a missing test extra only
# makes the tests that need it skip).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
TORCH_PIP_ARGS ?=
# `make test`: pytest-xdist workers (auto: one per CPU core; on 2 cores 2 beat 4) and extra arguments.
TEST_WORKERS ?= auto
PYTEST_ARGS ?=
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
BUILT := $(VENV)/.asyncpp-built
SOURCES := $(shell find csrc cmake -type f 2>/dev/null) CMakeLists.txt setup.py pyproject.toml
# pyproject.toml's [build-system].requires without `wheel`: setuptools builds wheels itself since
# 70.1, and without build isolation nothing else asks for it. cmake and ninja may also be programs
# on PATH (setup.py takes the PyPI package first, then PATH).
BUILD_REQUIRES := 'setuptools>=77' 'pybind11>=2.12' 'cmake>=3.26' ninja

.PHONY: demo test build build-check clean gpu-check
.DELETE_ON_ERROR:

# Prints those of the requirements given as arguments ("name" or "name>=version") that this
# interpreter lacks: not installed, or older (cmake and ninja: nor a recent enough program on PATH).
define REQ_MISSING
import re, shutil, subprocess, sys
from importlib import metadata
def numbers(version):
    return tuple(int(n) for n in re.findall(r"\d+", version)[:3])
def program_version(name):
    path = shutil.which(name)
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout if path else ""
    except (OSError, subprocess.SubprocessError):
        out = ""
    found = re.search(r"\d+(\.\d+)+", out)
    return found.group(0) if found else None
def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return program_version(name) if name in ("cmake", "ninja") else None
def present(spec):
    name, _, least = spec.partition(">=")
    have = version(name)
    return have is not None and (not least or numbers(have) >= numbers(least))
print(" ".join(s for s in sys.argv[1:] if not present(s)))
endef
export REQ_MISSING

# Prints asyncpp_ext's installed requirements: the unconditional ones, or those of the extra given
# as argument, with extras that name asyncpp_ext itself expanded.
define REQ_OF
import re, sys
from importlib import metadata
def requires(extra):
    out = []
    for line in metadata.requires("asyncpp_ext") or []:
        spec, _, marker = line.partition(";")
        wanted = re.search(r"extra\s*==\s*[\"']([^\"']+)[\"']", marker)
        if (wanted.group(1) if wanted else "") != extra:
            continue
        spec = re.sub(r"[\s()]", "", spec)
        own = re.match(r"asyncpp[-_]ext\[(.*)\]$$", spec)
        out += [r for e in own.group(1).split(",") for r in requires(e)] if own else [spec]
    return out
print(" ".join(requires(sys.argv[1] if len(sys.argv) > 1 else "")))
endef
export REQ_OF

# Run by $(PYTHON): its site-packages folders (a venv's, the system's, the user's).
BASE_SITES := import sys; print("\n".join(p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages"))))

demo: $(BUILT)
	$(PY) -m asyncpp_ext.training.demo

# The sources byte-compiled first: the suite starts a few hundred interpreters and ranks (CLI runs,
# forkservers, scripts), each of which would otherwise compile every module it imports where
# Python writes no bytecode itself (PYTHONDONTWRITEBYTECODE set, as on some CI machines).
test: $(BUILT)
	@$(PY) -c "import pytest" 2>/dev/null || { \
	  echo "make test: pytest is not installed in $(VENV) and could not be installed: $(PIP) install pytest"; exit 1; }
	@$(PY) -m compileall -q -j 0 asyncpp_ext tests bench examples > /dev/null || true  # pytest names a bad file
	$(PY) -m pytest $$($(PY) -c "import xdist" 2>/dev/null && echo "-n $(TEST_WORKERS) --dist loadgroup") $(PYTEST_ARGS)

build: $(BUILT)

# Scratch builds of the extension in other configurations (CUDA off, baseline ISA only, static
# libstdc++), each a full C++ build of its own: kept out of `make test`; CI runs both.
build-check: $(BUILT)
	$(PY) -m pytest -m buildcheck -p no:cacheprovider tests/test_build.py

# The venv. Where $(PYTHON) imports torch, the venv sees $(PYTHON)'s site packages after its own
# (site.addsitedir, so their .pth files work too): torch and the rest are not installed twice.
# venv's own --system-site-packages would not do when $(PYTHON) is itself a venv (it reaches only
# the base interpreter's packages). That venv gets no pip (and, before Python 3.12, no old
# setuptools of its own to shadow a newer one): $(PYTHON)'s pip installs into it.
$(PY):
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
	  echo "$(PYTHON) has torch $$($(PYTHON) -c 'import torch; print(torch.__version__)'): $(VENV) uses its packages"; \
	  $(PYTHON) -m venv --without-pip $(VENV) && \
	  sites=$$($(PYTHON) -c '$(BASE_SITES)') && \
	  purelib=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
	  $(PY) -c 'import sys; print("import site; list(map(site.addsitedir, %r))" % sys.argv[1:])' $$sites \
	    > "$$purelib/_asyncpp_base_site.pth" && \
	  { $(PY) -m pip --version >/dev/null 2>&1 || $(PY) -m ensurepip -q; } || { rm -rf $(VENV); exit 1; }; \
	else \
	  $(PYTHON) -m venv $(VENV); \
	fi

$(VENV)/.torch: | $(PY)
	@if $(PY) -c "import torch" 2>/dev/null; then \
	  echo "torch $$($(PY) -c 'import torch; print(torch.__version__)') already installed"; \
	elif nvidia-smi -L >/dev/null 2>&1; then \
	  echo "NVIDIA GPU found: installing torch==$(TORCH_VERSION)"; \
	  $(PIP) install -q "torch==$(TORCH_VERSION)" $(TORCH_PIP_ARGS) || { \
	    echo "make: cannot install torch==$(TORCH_VERSION) (no package index reachable?): install torch for $(PYTHON) or $(VENV)"; exit 1; }; \
	else \
	  echo "no NVIDIA GPU: installing the CPU build torch==$(TORCH_VERSION)+cpu"; \
	  $(PIP) install -q "torch==$(TORCH_VERSION)+cpu" $(TORCH_PIP_ARGS) || { \
	    echo "CPU build not reachable (set TORCH_PIP_ARGS='--index-url <PyTorch CPU index>');" \
	         "installing the default torch==$(TORCH_VERSION)"; \
	    $(PIP) install -q "torch==$(TORCH_VERSION)" $(TORCH_PIP_ARGS); } || { \
	    echo "make: cannot install torch==$(TORCH_VERSION) (no package index reachable?): install torch for $(PYTHON) or $(VENV)"; exit 1; }; \
	fi
	@touch $@

# Build requirements, installed once (and only those missing) so that re-builds can skip build
# isolation and stay incremental.
$(VENV)/.build-deps: pyproject.toml | $(PY)
	@missing=$$($(PY) -c "$$REQ_MISSING" $(BUILD_REQUIRES)) || exit 1; \
	if [ -n "$$missing" ]; then \
	  echo "installing the build requirements $$missing"; \
	  $(PIP) install -q $$missing || { \
	    echo "make: cannot install the build requirement(s) $$missing (no package index reachable?): install them for $(PYTHON) or $(VENV)"; exit 1; }; \
	fi
	@touch $@

# The package in place without its requirements, then only the requirements that are missing:
# torch, numpy, ... (needed) and the [test] extra (pytest, pytest-xdist, the optional features;
# the tests of a feature whose extra cannot be installed skip). The test requirements go in one pip
# call; if it fails (one of them unreachable: a machine with only a local package mirror), one at a
# time, so that pytest and every reachable extra are still installed.
$(BUILT): $(SOURCES) $(VENV)/.torch $(VENV)/.build-deps
	$(PIP) install -q --no-build-isolation --no-deps -e .
	@missing=$$($(PY) -c "$$REQ_MISSING" $$($(PY) -c "$$REQ_OF")) || exit 1; \
	if [ -n "$$missing" ]; then \
	  echo "installing the requirements $$missing"; \
	  $(PIP) install -q $$missing || { \
	    echo "make: cannot install the requirement(s) $$missing (no package index reachable?): install them for $(PYTHON) or $(VENV)"; exit 1; }; \
	fi
	@missing=$$($(PY) -c "$$REQ_MISSING" $$($(PY) -c "$$REQ_OF" test)) || exit 1; \
	if [ -n "$$missing" ]; then \
	  echo "installing the test requirements $$missing"; \
	  log=$$(mktemp); \
	  $(PIP) install -q $$missing 2>$$log || { \
	    failed=""; \
	    for req in $$missing; do $(PIP) install -q "$$req" 2>$$log || failed="$$failed $$req"; done; \
	    [ -z "$$failed" ] || \
	      echo "make: cannot install the test requirement(s)$$failed ($$(grep -m1 '^ERROR' $$log || echo 'no package index reachable?')); the tests that need them skip"; }; \
	  rm -f $$log; \
	fi
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
