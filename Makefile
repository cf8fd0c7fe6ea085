# One-command set-up: `make test` and `make demo` build .venv from nothing when it is missing
# or older than the dependency files, then run.  GPU=1 installs the CUDA fbgemm-gpu instead.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
GPU ?= 0
FBGEMM_EXTRA := $(if $(filter 1,$(GPU)),gpu,cpu)
# Extras read from pyproject.toml, so the dependency list lives in one place.
extras = $(shell $(PYTHON) -c "import tomllib; d = tomllib.load(open('pyproject.toml', 'rb')); print(' '.join(\"'\" + r + \"'\" for e in '$(1)'.split() for r in d['project']['optional-dependencies'][e]))")

.PHONY: test demo venv clean

$(VENV)/.stamp: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "torch==2.13.0" numpy $(call extras,$(FBGEMM_EXTRA))
	$(PIP) install --quiet --no-deps "torchrec==1.8.0"
	$(PIP) install --quiet $(call extras,torchrec-runtime dev plot)
	$(PIP) install --quiet --no-deps -e .
	$(PY) -c "import torch, torchrec, fbgemm_gpu, embark_torchrec; print('environment ready: torch', torch.__version__, 'torchrec', torchrec.__version__)"
	touch $@

venv: $(VENV)/.stamp

test: $(VENV)/.stamp
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q tests

demo: $(VENV)/.stamp
	$(VENV)/bin/torchrun --standalone --nproc_per_node 2 examples/dlrm/train.py

clean:
	rm -rf $(VENV)
