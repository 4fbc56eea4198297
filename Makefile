# The two commands: `make train` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
FT_STAMP := $(VENV)/.installed-ft
# make train: one rank per GPU where there are GPUs, else 2 on CPU (launcher.nproc=auto); NPROC=N overrides.
NPROC ?=
# The versions the suite and the documents were measured with; CONSTRAINTS= installs without pins.
CONSTRAINTS ?= constraints.txt

.PHONY: setup train test test-all tour bench-collectives clean

setup: $(STAMP)

# Reinstall when the project's dependencies or their pins change. (Byte-compiled at install: with
# PYTHONDONTWRITEBYTECODE=1, as here and in CI, nothing imported later would ever be cached.)
$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]' $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
	touch $(STAMP)

# The main job: minidist ddp, gpt_nano on the embedded stdlib_text, NPROC local ranks.
train: setup
	OMP_NUM_THREADS=1 $(PY) recipes/train.py $(if $(NPROC),launcher.nproc=$(NPROC)) $(ARGS)

# The ft extra (torchft, for ft=torchft): make test-all's live-recovery tests need it; train and test never do.
$(FT_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,ft]' $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
	touch $(FT_STAMP)

# The fast suite, run often: everything but the tests marked slow.
test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not slow"

# Everything: the slow end-to-end tests, emulated hosts (root), the soak. What CI runs.
test-all: setup $(FT_STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q

tour: setup
	OMP_NUM_THREADS=1 $(PY) recipes/tour.py nproc=$(or $(NPROC),2)

bench-collectives: setup
	OMP_NUM_THREADS=1 $(PY) recipes/bench_collectives.py nproc=$(or $(NPROC),2)

clean:
	rm -rf $(VENV) outputs runs .pytest_cache
