# The two commands: `make train` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NPROC ?= 2

.PHONY: setup train test tour bench-collectives clean

setup: $(STAMP)

# Reinstall when the project's dependencies change.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# Until the trainer exists, the main job is the primitives tour.
train: setup
	OMP_NUM_THREADS=1 $(PY) recipes/tour.py nproc=$(NPROC)

test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q

tour: setup
	OMP_NUM_THREADS=1 $(PY) recipes/tour.py nproc=$(NPROC)

bench-collectives: setup
	OMP_NUM_THREADS=1 $(PY) recipes/bench_collectives.py nproc=$(NPROC)

clean:
	rm -rf $(VENV) outputs runs .pytest_cache
