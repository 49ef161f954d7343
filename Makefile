# dspark-triton: every entry point a user touches. `make demo` and `make test` each work on a
# fresh clone (both run `setup` first, which is idempotent and cheap once done).
PY      := .venv/bin/python
PYTEST  := $(PY) -m pytest
export OMP_NUM_THREADS ?= 2

.PHONY: setup demo test test-fast test-slow lint clean data train eval

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

# Drafters (issue 3): regenerate training answers + target cache (resumable), train, evaluate.
data: setup
	$(PY) -m dspark.cli data

train: data
	$(PY) -m dspark.cli train --kind dspark
	$(PY) -m dspark.cli train --kind dflash
	$(PY) -m dspark.cli train --kind eagle3

EVAL_SETS := gsm8k-test humaneval mt-bench
eval: setup
	for d in dspark dflash eagle3; do for s in $(EVAL_SETS); do for t in 0 1; do \
	  $(PY) -m dspark.cli eval --drafter $$d --data ../shared/data/eval/$$s.jsonl --limit 40 \
	    --max-new-tokens 256 --temperature $$t --json artifacts/eval/$$d-$$s-T$$t.json || exit 1; \
	done; done; done
	$(PY) -m dspark.cli report

lint: setup
	$(PY) -m ruff check dspark tests
	$(PY) -m ruff format --check dspark tests

clean:
	rm -rf build artifacts .pytest_cache
