# dspark-triton: every entry point a user touches. `make demo` and `make test` each work on a
# fresh clone (both run `setup` first, which is idempotent and cheap once done).
PY      := .venv/bin/python
PYTEST  := $(PY) -m pytest
export OMP_NUM_THREADS ?= 2

.PHONY: setup demo test test-fast test-slow lint clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m dspark.cli demo

test: setup
	$(PYTEST) -q tests

test-fast: setup
	$(PYTEST) -q tests -m "not slow"

test-slow: setup
	$(PYTEST) -q tests -m slow

lint: setup
	$(PY) -m ruff check dspark tests
	$(PY) -m ruff format --check dspark tests

clean:
	rm -rf build artifacts .pytest_cache
