# hybridpipe: `make test` installs into .venv (if needed) and runs the test suite; `make lint`
# runs the linter and the type checker (configured in pyproject.toml).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install lint test test-slow test-cuda demo demo-alexnet clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

lint: install
	$(PY) -m ruff check hybridpipe launch.py tools tests benchmarks
	$(PY) -m mypy

test: install
	$(PY) -m pytest

test-slow: install
	$(PY) -m pytest -m slow
	HYBRIDPIPE_BAD_INPUT_EXAMPLES=40 $(PY) -m pytest tests/test_bad_inputs_property.py

test-cuda: install
	$(PY) -m pytest -m cuda

demo: install
	PY=$(PY) examples/demo.sh

demo-alexnet: install
	PY=$(PY) examples/demo_alexnet.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis .ruff_cache .mypy_cache out
