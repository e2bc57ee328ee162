# jaxsoft — every target sets up what it needs in .venv first (a fresh clone needs nothing else).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# pytest workers: one per core by default.
JOBS   ?= auto
# sphinx-build workers for `make docs`.
DOCS_JOBS ?= auto
# What `.venv/.base` installs: the test, training and notebook tools, and the outside oracles
# (PyTorch, flash-linear-attention) the tests compare against.
EXTRAS ?= test,train,notebooks,oracles

.PHONY: demo test test-unit test-notebooks test-slow test-quick lint typecheck bench gallery notebooks docs docs-test clean

$(VENV)/.base: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e ".[$(EXTRAS)]"
	touch $@

$(VENV)/.docs: $(VENV)/.base
	$(PIP) install -q -e ".[docs]"
	touch $@

$(VENV)/.bench: $(VENV)/.base
	$(PIP) install -q -e ".[bench]"
	touch $@

## The main job: set up, then train the smoke decoder LM on CPU (about a minute).
## It installs the library and the training extra only (not the test tools or the oracles).
demo:
	test -x $(PY) || { $(PYTHON) -m venv $(VENV) && $(PIP) install -q --upgrade pip; }
	$(PIP) install -q -e ".[train]"
	rm -rf runs/demo
	$(PY) train/train.py --preset smoke --workdir runs/demo

## Every registered normalizer applied to one sample row.
gallery: $(VENV)/.base
	$(PY) -m jaxsoft

## The default test suite: unit tests (slow sweeps excluded), then every notebook with small sizes.
test: test-unit test-notebooks

test-unit: $(VENV)/.base
	$(PY) -m pytest -n $(JOBS) -q

test-notebooks: $(VENV)/.base
	JAXSOFT_NOTEBOOK_QUICK=1 MPLBACKEND=Agg $(PY) -m pytest -n $(JOBS) -q --nbmake notebooks

test-slow: $(VENV)/.base
	$(PY) -m pytest -n $(JOBS) -q -m slow

## The quick inner loop: unit tests without Pallas interpret-mode kernels, subprocesses or slow sweeps.
test-quick: $(VENV)/.base
	$(PY) -m pytest -n $(JOBS) -q -m "not kernels and not subprocess and not slow and not browser"

lint: $(VENV)/.base
	$(PY) -m ruff check jaxsoft kernels_pallas tests bench train

## Static type check of the library (mypy; its configuration is the [mypy] section of setup.cfg).
typecheck: $(VENV)/.base
	$(PY) -m mypy jaxsoft kernels_pallas

## Re-sync each notebook with its plain-text twin (edit the .py, then run this).
notebooks: $(VENV)/.base
	$(VENV)/bin/jupytext --sync notebooks/[0-9][0-9]_*.py

## CPU benchmarks (the figures in docs/benchmarks.md); bench/gpu.py runs on a GPU machine.
bench: $(VENV)/.bench
	$(PY) bench/normalizers.py
	$(PY) bench/attention_cpu.py
	$(PY) bench/train_tokens.py
	$(PY) bench/residuals.py
	$(PY) bench/functions_cpu.py

## The zoo (train/zoo.py): every entrant on every task, 3-point sweep + 2 more seeds, appended to
## bench/zoo/results.jsonl (resumable; ZOO_ARGS="--parts 2/6" runs one part), then the report.
.PHONY: zoo zoo-tiny
zoo: $(VENV)/.base
	$(PY) -m train.zoo run $(ZOO_ARGS)
	$(PY) -m train.zoo report

## The zoo's plumbing at CI sizes (two entrants, one task) into runs/zoo-tiny.
zoo-tiny: $(VENV)/.base
	$(PY) -m train.zoo run --tiny --out runs/zoo-tiny --only task=lm entrant=normalizer:softmax,normalizer:relu
	$(PY) -m train.zoo report --tiny --out runs/zoo-tiny

## The documentation site in docs/_build/html (Sphinx + MyST-NB + sphinx-book-theme; docs/conf.py):
## warnings are errors (-W), cross-references nitpicky (-n); notebooks render their committed outputs.
## Every page is read afresh (-E: an incremental build would not repeat an earlier build's warnings).
docs: $(VENV)/.docs
	$(PY) -m sphinx -b html -E -W --keep-going -n -q -j $(DOCS_JOBS) docs docs/_build/html

## The built site in headless Chromium (tests/docs/test_browser.py): fails, not skips, without a browser.
docs-test: docs
	$(PY) -m pytest -q -m browser tests/docs

clean:
	rm -rf $(VENV) build *.egg-info runs
