# make demo  -- build .venv, install the project, train the digits recipe on all local devices
# make test  -- build .venv with the test extras, lint, run the whole suite (two workers; WORKERS=0: one)
# make test-fast -- the edit loop: the suite without the tests that start processes or are slow
#                   (markers `processes`, set by tests/conftest.py, and `slow`), no lint; under 2 minutes
# make test-slurm -- the SLURM tests: a one-node cluster started for them (root; apt installs slurm-wlm)
# make docs  -- install the docs extra into .venv, build the site in docs/ into site/ (mkdocs build --strict)
# make test-compat -- a subset of the tests in fresh venvs at the declared floor (oldest Python, torch,
#                     Lightning, ...), at torch 2.8 (gloo-sum) and at the newest releases; see
#                     tests/compat/run.sh (downloads torch's CUDA wheels once into ~/.cache/uv: about 3 GB
#                     per torch version, three versions)
#
# Torch: the venv gets torch $(TORCH_VERSION) from your pip index. PyPI's Linux wheel is the CUDA build
# (about 3 GB) on every machine; a CPU-only box asks for the CPU build, and a torch the venv can already
# import is kept (docs/install.md):
#   make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu   # the CPU build
#   make venv SYSTEM_SITE_PACKAGES=1   # reuse the system's CUDA torch
#   make venv TORCH_SPEC="torch==2.9.1" TORCH_INDEX=https://download.pytorch.org/whl/cu128

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
TORCH_SPEC ?= torch==$(TORCH_VERSION)
TORCH_INDEX ?=
SYSTEM_SITE_PACKAGES ?= 0
PYTEST_ARGS ?=

BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --disable-pip-version-check -q

.PHONY: venv test-venv demo test test-fast test-slurm test-compat lint format clean

venv: $(VENV)/.stamp-base

test-venv: $(VENV)/.stamp-test

$(VENV)/.stamp-torch: Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(if $(filter 1,$(SYSTEM_SITE_PACKAGES)),--system-site-packages) $(VENV)
	@if $(BIN)/python -c "import torch" 2>/dev/null; then \
		echo "keeping installed torch $$($(BIN)/python -c 'import torch; print(torch.__version__)')"; \
	else \
		echo "installing $(TORCH_SPEC)"; \
		$(PIP) install "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)); \
	fi
	@touch $@

$(VENV)/.stamp-base: $(VENV)/.stamp-torch pyproject.toml
	$(PIP) install -e ".[plot,recipes]"
	@touch $@

$(VENV)/.stamp-test: $(VENV)/.stamp-base
	$(PIP) install -e ".[test]"
	@touch $@

demo: venv
	$(BIN)/lightning-mgpu run digits

lint: test-venv
	$(BIN)/ruff check lightning_mgpu recipes tests benchmarks notebooks
	$(BIN)/ruff format --check lightning_mgpu recipes tests benchmarks notebooks
	$(BIN)/mypy

format: test-venv
	$(BIN)/ruff format lightning_mgpu recipes tests benchmarks notebooks
	$(BIN)/ruff check --fix lightning_mgpu recipes tests benchmarks notebooks

# two workers, each test file on one (its module fixtures run once): the suite alone keeps about one of two
# cores busy, its multi-process tests waiting on heartbeats and timeouts; WORKERS=0 runs it in this process
WORKERS ?= 2
XDIST := $(if $(filter-out 0,$(WORKERS)),-n $(WORKERS) --dist loadfile)

test: lint
	$(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)

# this -m replaces pyproject's `-m 'not slurm'`, so it leaves slurm out itself
test-fast: test-venv
	$(BIN)/python -m pytest -m "not processes and not slow and not slurm" $(PYTEST_ARGS)

# not part of `make test`: pyproject's addopts leave the slurm marker out, `-m slurm` brings it back
test-slurm: test-venv
	$(BIN)/python -m pytest -m slurm tests/slurm $(PYTEST_ARGS)

# COMPAT="floor", "gloo-sum" or "newest" runs one combination
COMPAT ?= floor gloo-sum newest
test-compat:
	bash tests/compat/run.sh $(COMPAT)

# --strict: a broken link or anchor, a page left out of the nav or an unresolved API reference fails
.PHONY: docs
docs: $(VENV)/.stamp-docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

$(VENV)/.stamp-docs: $(VENV)/.stamp-base
	$(PIP) install -e ".[docs]"
	@touch $@

clean:
	rm -rf $(VENV) .compat .pytest_cache .mypy_cache .ruff_cache
