# One-command set-up: `make test` and `make demo` build .venv from nothing when it is missing
# or older than the dependency files, then run.  GPU=1 installs the CUDA fbgemm-gpu instead.
# `make test-torchrec VERSION=1.6` (1.6, 1.7, 1.8, 1.9) builds .venv-torchrec1.6 with that TorchRec and the torch
# and fbgemm it is built for, the same way, and runs the tests marked `torchrec_version` there.  The torch wheels
# PyPI serves for Linux are CUDA builds that pull the nvidia-* wheels (a few GB, cached by pip); they run on the CPU.
# `make wheelhouse TORCH=2.11 CUDA=13 PYTHON=3.12` downloads what a GPU host without internet needs beside its torch
# (scripts/wheelhouse.py; docs/install.md, "On a GPU host without internet").
HOST_PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
GPU ?= 0
FBGEMM_EXTRA := $(if $(filter 1,$(GPU)),gpu,cpu)
FBGEMM_PACKAGE := $(if $(filter 1,$(GPU)),fbgemm-gpu,fbgemm-gpu-cpu)
VERSION ?= 1.9
DEFAULT_VERSION := 1.8
# The tested stacks live in pyproject.toml ([tool.embark-torchrec.stacks]): $(call stack,1.6) is "torch fbgemm torchrec".
stack = $(or $(shell $(HOST_PYTHON) -c "import tomllib; s = tomllib.load(open('pyproject.toml', 'rb'))['tool']['embark-torchrec']['stacks'].get('$(1)'); print(s['torch'], s['fbgemm'], s['torchrec']) if s else None"),$(error VERSION=$(1) is not a TorchRec release we test; see [tool.embark-torchrec.stacks] in pyproject.toml))
# Extras read from pyproject.toml, so the dependency list lives in one place.
extras = $(shell $(HOST_PYTHON) -c "import tomllib; d = tomllib.load(open('pyproject.toml', 'rb')); print(' '.join(\"'\" + r + \"'\" for e in '$(1)'.split() for r in d['project']['optional-dependencies'][e]))")

# $(call build_venv,DIR,TORCH,FBGEMM,TORCHREC): a venv in DIR with exactly those versions (each within
# pyproject.toml's ranges, which the fbgemm extra brings along), the extras and this checkout in editable mode.
# torch is pinned in every install so that no dependency's own range moves it.  The stamp holds the versions:
# a venv is reused while its stamp is newer than the dependency files and names the same stack.
define build_venv
	$(HOST_PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install --quiet --upgrade pip
	$(1)/bin/python -m pip install --quiet "torch==$(2)" numpy $(call extras,$(FBGEMM_EXTRA)) "$(FBGEMM_PACKAGE)==$(3)"
	$(1)/bin/python -m pip install --quiet --no-deps "torchrec==$(4)"
	$(1)/bin/python -m pip install --quiet "torch==$(2)" $(call extras,dev plot)
	$(1)/bin/python -m pip install --quiet "torch==$(2)" -e .
	$(1)/bin/python -c "import torch, torchrec, fbgemm_gpu, embark_torchrec; print('environment ready: torch', torch.__version__, 'fbgemm_gpu', fbgemm_gpu.__version__, 'torchrec', torchrec.__version__)"
	echo "$(2) $(3) $(4)" > $(1)/.stamp
endef

.PHONY: test test-slow test-torchrec wheelhouse demo venv clean FORCE

$(VENV)/.stamp: pyproject.toml Makefile
	$(call build_venv,$(VENV),$(word 1,$(call stack,$(DEFAULT_VERSION))),$(word 2,$(call stack,$(DEFAULT_VERSION))),$(word 3,$(call stack,$(DEFAULT_VERSION))))

# A version's venv is rebuilt when the dependency files are newer than its stamp or its stamp names another stack.
.venv-torchrec%/.stamp: pyproject.toml Makefile FORCE
	@if [ "$$(cat $@ 2>/dev/null)" != "$(call stack,$*)" ] || [ -n "$$(find pyproject.toml Makefile -newer $@ 2>/dev/null)" ]; then \
		$(MAKE) --no-print-directory build-venv-torchrec$*; fi

build-venv-torchrec%:
	$(call build_venv,.venv-torchrec$*,$(word 1,$(call stack,$*)),$(word 2,$(call stack,$*)),$(word 3,$(call stack,$*)))

venv: $(VENV)/.stamp

# The planning layer first (tests/plan: no gloo ranks, no torchrun), so that its failures show before the long rest;
# the layers are markers that tests/conftest.py sets by folder.  TEST_WORKERS pytest-xdist workers share the tests:
# the planning layer test by test, the rest file by file (a file's ranks and torchrun jobs stay in one worker, and
# test_torchrec_harness.py runs each world size's cases once per worker that reads them).  TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: $(VENV)/.stamp
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not slow" tests/plan
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not plan and not slow" tests

test-slow: $(VENV)/.stamp
	$(PY) -m pytest -q -m slow tests

# The default release's suites run in .venv, which `make test` builds.
TORCHREC_VENV = $(if $(filter $(DEFAULT_VERSION),$(VERSION)),$(VENV),.venv-torchrec$(VERSION))

test-torchrec: $(TORCHREC_VENV)/.stamp
	$(TORCHREC_VENV)/bin/python -m pytest -q -m torchrec_version tests

wheelhouse:
	$(if $(and $(TORCH),$(CUDA),$(PYTHON)),,$(error make wheelhouse needs TORCH, CUDA and PYTHON, e.g. make wheelhouse TORCH=2.11 CUDA=13 PYTHON=3.12))
	$(HOST_PYTHON) scripts/wheelhouse.py --torch $(TORCH) --cuda $(CUDA) --python $(PYTHON)

demo: $(VENV)/.stamp
	$(VENV)/bin/torchrun --standalone --nproc_per_node 2 examples/dlrm/train.py

clean:
	rm -rf $(VENV) .venv-torchrec*
