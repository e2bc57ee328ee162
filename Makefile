# jaxsoft — every target sets up what it needs in .venv first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# pytest workers: one per core by default.
JOBS   ?= auto

.PHONY: demo test test-slow lint bench gallery clean

$(VENV)/.base: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e ".[test,train]"
	touch $@

$(VENV)/.bench: $(VENV)/.base
	$(PIP) install -q -e ".[bench]"
	touch $@

$(VENV)/.notebooks: $(VENV)/.base
	$(PIP) install -q -e ".[notebooks]"
	touch $@

## The main job: set up, then show every registered normalizer on one row.
demo: $(VENV)/.base
	rm -rf runs/demo
	$(PY) train/train.py --preset smoke --workdir runs/demo

gallery: demo

## The default test suite (slow sweeps excluded; run `make test-slow` for them).
test: $(VENV)/.base
	$(PY) -m pytest -n $(JOBS) -q

test-slow: $(VENV)/.base
	$(PY) -m pytest -n $(JOBS) -q -m slow

lint: $(VENV)/.base
	$(PY) -m ruff check jaxsoft kernels_pallas tests bench

bench: $(VENV)/.bench
	$(PY) bench/normalizers.py

clean:
	rm -rf $(VENV) build *.egg-info
