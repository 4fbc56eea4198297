# The two commands: `make train` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# make train: one rank per GPU where there are GPUs, else 2 on CPU (launcher.nproc=auto); NPROC=N overrides.
NPROC ?=
# The versions the suite and the documents were measured with; CONSTRAINTS= installs without pins.
CONSTRAINTS ?= constraints.txt

.PHONY: setup train test test-all tour bench-collectives clean

setup: $(STAMP)

# Reinstall when the project's dependencies or their pins change. --no-compile: pip would byte-compile
# all of torch (9,500 files, 30 s of a 80 s install on 2 cores); Python compiles what a run imports.
$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile -e '.[dev]' $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
	touch $(STAMP)

# The main job: minidist ddp, gpt_nano on the embedded stdlib_text, NPROC local ranks.
train: setup
	OMP_NUM_THREADS=1 $(PY) recipes/train.py $(if $(NPROC),launcher.nproc=$(NPROC)) $(ARGS)

# The fast suite, run often: everything but the tests marked slow.
test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not slow"

# Everything: the slow end-to-end tests, emulated hosts (root), the soak. What CI runs.
test-all: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q

tour: setup
	OMP_NUM_THREADS=1 $(PY) recipes/tour.py nproc=$(or $(NPROC),2)

bench-collectives: setup
	OMP_NUM_THREADS=1 $(PY) recipes/bench_collectives.py nproc=$(or $(NPROC),2)

clean:
	rm -rf $(VENV) outputs runs .pytest_cache
