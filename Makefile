# Two commands for a fresh machine (CPU-only or GPU host):
#   make demo   set up .venv, then generate offline with a tiny checkpoint built on the spot
#   make test   set up .venv, then run the test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU build of torch; a host that already has torch (a GPU image) keeps its own.
TORCH_VERSION ?= 2.13.0

.PHONY: setup demo test lint

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	# Pin whatever torch is now present so no dependency upgrades it (and pulls CUDA wheels).
	$(PY) -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/constraints.txt
	$(PY) -m pip install -q -e ".[test]" -c $(VENV)/constraints.txt
	touch $@

demo: setup
	$(PY) samples/offline_generate.py

test: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
