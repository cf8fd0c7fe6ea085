# One-command set-up: `make test` and `make demo` build .venv from nothing when it is missing
# or older than the dependency files, then run.  GPU=1 installs the CUDA fbgemm-gpu instead.
# `make test-torchrec19` builds .venv19 (torch 2.14.0, fbgemm 1.9.0, torchrec 1.9.2) the same way and runs
# TORCHREC_SUITES there; it stays out of `make test`, as torch 2.14's PyPI wheel pulls several GB of CUDA wheels.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
VENV19 := .venv19
GPU ?= 0
FBGEMM_EXTRA := $(if $(filter 1,$(GPU)),gpu,cpu)
FBGEMM_PACKAGE := $(if $(filter 1,$(GPU)),fbgemm-gpu,fbgemm-gpu-cpu)
# The suites that read TorchRec's and fbgemm's internals, run on every TorchRec we support: the compat checks,
# TorchRec's own test harness and ours, and the sharded-equals-unsharded exactness tests.
TORCHREC_SUITES := tests/test_torchrec_compat.py tests/test_smoke_torchrec.py tests/compat tests/test_testing_harness.py \
	$(sort $(wildcard tests/test_sharding_*.py)) tests/test_qcomms.py tests/test_variable_batch.py \
	tests/test_rowwise_adagrad.py tests/test_shared_features.py tests/test_managed_collision.py tests/test_data_parallel.py
# Extras read from pyproject.toml, so the dependency list lives in one place.
extras = $(shell $(PYTHON) -c "import tomllib; d = tomllib.load(open('pyproject.toml', 'rb')); print(' '.join(\"'\" + r + \"'\" for e in '$(1)'.split() for r in d['project']['optional-dependencies'][e]))")

# $(call build_venv,DIR,TORCH,FBGEMM,TORCHREC): a venv in DIR with exactly those versions (each within
# pyproject.toml's ranges, which the fbgemm extra brings along), the extras and this checkout in editable mode.
define build_venv
	$(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install --quiet --upgrade pip
	$(1)/bin/python -m pip install --quiet "torch==$(2)" numpy $(call extras,$(FBGEMM_EXTRA)) "$(FBGEMM_PACKAGE)==$(3)"
	$(1)/bin/python -m pip install --quiet --no-deps "torchrec==$(4)"
	$(1)/bin/python -m pip install --quiet $(call extras,dev plot)
	$(1)/bin/python -m pip install --quiet -e .
	$(1)/bin/python -c "import torch, torchrec, fbgemm_gpu, embark_torchrec; print('environment ready: torch', torch.__version__, 'torchrec', torchrec.__version__)"
	touch $(1)/.stamp
endef

.PHONY: test test-torchrec19 demo venv clean

$(VENV)/.stamp: pyproject.toml Makefile
	$(call build_venv,$(VENV),2.13.0,1.8.0,1.8.0)

$(VENV19)/.stamp: pyproject.toml Makefile
	$(call build_venv,$(VENV19),2.14.0,1.9.0,1.9.2)

venv: $(VENV)/.stamp

test: $(VENV)/.stamp
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q tests

test-torchrec19: $(VENV19)/.stamp
	$(VENV19)/bin/python -m pytest -q $(TORCHREC_SUITES)

demo: $(VENV)/.stamp
	$(VENV)/bin/torchrun --standalone --nproc_per_node 2 examples/dlrm/train.py

clean:
	rm -rf $(VENV) $(VENV19)
