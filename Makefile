# Commands for a fresh machine (CPU-only or GPU host):
#   make serve  set up, then serve the bundled demo VLM and its web page on 127.0.0.1:8000
#               (make serve MODEL=/path/to/checkpoint ARGS="--port 8001 --max-model-len 4096")
#   make test   set up, then run the test suite
#   make demo   set up, then generate offline with the bundled demo VLM
PYTHON ?= python3
MODEL ?=
ARGS ?=
VENV := .venv
# pytest-xdist (the test extra) runs test files on TEST_WORKERS processes (more than the cores:
# many tests wait on the servers and engines they start), each file whole on
# one of them, so that a module's server starts once; an offline host without it runs serially.
TEST_WORKERS ?= 3
TEST_XDIST := -n $(TEST_WORKERS) --dist loadfile
# CPU build of torch, for hosts without one (a CUDA build would pull GBs of wheels).
TORCH_VERSION ?= 2.13.0
# A host whose python already has torch (a GPU image) is used as it is; others get .venv.
HOST_HAS_TORCH := $(shell $(PYTHON) -c "import torch" 2>/dev/null && echo yes)
ifeq ($(HOST_HAS_TORCH),yes)
PY := $(PYTHON)
else
PY := $(VENV)/bin/python
endif

.PHONY: setup serve demo test lint

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
ifeq ($(HOST_HAS_TORCH),yes)
	mkdir -p $(VENV)
else
	@echo "== Creating $(VENV) and installing torch $(TORCH_VERSION) (CPU build; about 30 s)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)"
endif
	# Pin the torch now present so no dependency upgrades it.
	$(PY) -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/constraints.txt
	@echo "== Installing mm_serve and its dependencies (about a minute on a fresh machine)"
	# An offline host that already has every dependency takes the fallback.
	$(PY) -m pip install -q -e ".[test]" -c $(VENV)/constraints.txt \
	  || $(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

serve: setup
	$(PY) -m mm_serve.entrypoints.cli serve $(MODEL) $(ARGS)

demo: setup
	$(PY) samples/offline_generate.py

test: setup
	if $(PY) -c "import xdist" 2>/dev/null; then $(PY) -m pytest -q $(TEST_XDIST); \
	else $(PY) -m pytest -q; fi

lint: setup
	$(PY) -m pip install -q ruff
	$(PY) -m ruff check . && $(PY) -m ruff format --check .
