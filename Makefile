# Two commands from a fresh clone:
#   make demo   set up .venv (if missing) and run a local demo swarm
#   make test   set up .venv (if missing) and run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0
DEMO_ARGS ?=

.PHONY: demo test lint format bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, by itself: this takes the CPU build where one is available.
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/swarmtrain demo $(DEMO_ARGS)

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: $(STAMP)
	$(PY) benchmarks/transport.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
