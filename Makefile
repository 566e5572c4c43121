# make test : create .venv, install torch + indexer-q[test], run the tests
# make demo : create .venv, install torch + indexer-q, run `python -m indexer_q demo`
# TORCH picks the torch requirement, e.g. TORCH=torch==2.13.0 (CPU CI) or a CUDA build.
PYTHON ?= python3
TORCH  ?= torch
VENV   := .venv
PY     := $(VENV)/bin/python

.PHONY: test demo venv clean

$(PY):
	$(PYTHON) -m venv $(VENV)

venv: $(PY)
	$(PY) -m pip install -q '$(TORCH)'
	$(PY) -m pip install -q -e '.[test]'

test: venv
	$(PY) -m pytest -q tests

demo: venv
	$(PY) -m indexer_q demo

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
