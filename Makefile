# dspark-triton: every entry point a user touches. `make demo` and `make test` each work on a
# fresh clone (both run `setup` first, which is idempotent and cheap once done).
PY      := .venv/bin/python
PYTEST  := $(PY) -m pytest
export OMP_NUM_THREADS ?= 2
SHARED  ?= $(or $(DSPARK_SHARED),../shared)

.PHONY: gpu-check gpu-probe setup demo test test-fast test-slow test-integration lint clean data train eval engines serve sps bench \
        replicas-test soak deploy

# GPU=1 adds the GPU stack (requirements-gpu.txt: CUDA torch, TensorRT, onnxruntime-gpu); with
# GPU_WHEELS=DIR (default ../gpu-wheels when it exists) from that folder only (offline machines).
GPU ?= 0
setup:
	@GPU=$(GPU) bash scripts/setup.sh

# The demo builds the engines on first use (~2 min), starts tritonserver on free loopback ports,
# streams one answer per domain with DSpark and times target-only on the same prompt.
demo: setup
	@[ -f build/engines/manifest.json ] || $(PY) -m dspark.cli engines --drafter dspark --out build/engines
	$(PY) -m dspark.cli demo --engines build/engines

# tests/unit: tiny models, no server (a few minutes); tests/slow: the real SmolLM2 target;
# tests/integration: a real tritonserver on 127.0.0.1.
test: setup
	$(PYTEST) -q tests

test-fast: setup
	$(PYTEST) -q tests/unit

test-slow: setup
	$(PYTEST) -q tests/slow

test-integration: setup
	$(PYTEST) -q tests/integration

# Drafters (issue 3): regenerate training answers + target cache (resumable), train, evaluate.
# Every pool of train_prompts, round-robin over math / code / chat; on the ONNX Runtime target
# engine when `make engines` has built one (same tokens as the PyTorch loop, issue 12).
data: setup
	$(PY) -m dspark.cli data --pools all $$( [ -f build/engines/target.opt.onnx ] && echo --engines build/engines )

# `make train` trains on the answers already regenerated (the committed snapshot on a fresh clone);
# run `make data` first to generate the rest. Same token budget for the three drafters, in the
# ten stages the shipped drafters were made in (issue 12): TRAIN_STEPS from scratch at lr 6e-4,
# then CONTINUE_STEPS, THIRD_STEPS, FOURTH_STEPS, FIFTH_STEPS, SIXTH_STEPS, SEVENTH_STEPS, EIGHTH_STEPS,
# NINTH_STEPS and TENTH_STEPS more, each from the previous stage's fp16 drafter at lr 3e-4 (what
# `--init-from` does with a shipped drafter), 11,300 steps in all; only the last fits DSpark's STS
# (240 held-out prompts, ~22 min). Every stage resumes from its checkpoints. The shipped
# drafters' stages saw 632, 746, 1,229, 1,879, 4,688, 4,688, 7,058, 3,255, 3,559 and 7,457 answers (the
# last three: the part of 8,967, 10,314 and 12,217 a machine had cached, their training_files.txt); here
# all ten see what is there. (scripts/next_stage.sh adds one more stage to the shipped drafters.)
TRAIN_STEPS ?= 500
CONTINUE_STEPS ?= 400
THIRD_STEPS ?= 800
FOURTH_STEPS ?= 800
FIFTH_STEPS ?= 1000
SIXTH_STEPS ?= 1500
SEVENTH_STEPS ?= 1500
EIGHTH_STEPS ?= 1500
NINTH_STEPS ?= 1500
TENTH_STEPS ?= 1800
train: setup
	$(PY) -m dspark.cli data --no-generate $$( [ -f build/engines/target.opt.onnx ] && echo --engines build/engines )
	for k in dspark dflash eagle3; do \
	  $(PY) -m dspark.cli train --kind $$k --steps $(TRAIN_STEPS) --out artifacts/runs/$$k \
	    --ship artifacts/stage1/$$k --sts-prompts 0 || exit 1; \
	  prev=artifacts/stage1/$$k; stage=2; \
	  for steps in $(CONTINUE_STEPS) $(THIRD_STEPS) $(FOURTH_STEPS) $(FIFTH_STEPS) $(SIXTH_STEPS) \
	    $(SEVENTH_STEPS) $(EIGHTH_STEPS) $(NINTH_STEPS) $(TENTH_STEPS); do \
	    ship=$$( [ $$stage = 10 ] && echo drafters/$$k || echo artifacts/stage$$stage/$$k ); \
	    $(PY) -m dspark.cli train --kind $$k --init-from $$prev --steps $$steps --lr 3e-4 \
	      --out artifacts/runs/$$k-stage$$stage --ship $$ship $$( [ $$stage = 10 ] || echo --sts-prompts 0 ) \
	      || exit 1; \
	    prev=$$ship; stage=$$((stage + 1)); done; done

EVAL_SETS  := gsm8k-test humaneval mt-bench
EVAL_LIMIT ?= 24
EVAL_TOKENS ?= 96
EVAL_OUT ?= docs/acceptance/evals
# EVAL_SKIP_DONE=1 keeps cells whose JSON already exists (resuming an interrupted run).
EVAL_SKIP_DONE ?=
# Loops set → temperature → drafter, so an interrupted run still compares the three drafters.
eval: setup
	for s in $(EVAL_SETS); do for t in 0 1; do for d in dspark dflash eagle3; do \
	  out=$(EVAL_OUT)/$$d-$$s-T$$t.json; \
	  if [ -n "$(EVAL_SKIP_DONE)" ] && [ -f $$out ]; then continue; fi; \
	  $(PY) -m dspark.cli eval --drafter $$d --data $(SHARED)/data/eval/$$s.jsonl --limit $(EVAL_LIMIT) \
	    --max-new-tokens $(EVAL_TOKENS) --batch 8 --temperature $$t --json $$out \
	    $$( [ -f build/engines/target.opt.onnx ] && echo --engines build/engines ) \
	    || exit 1; \
	done; done; done
	$(PY) -m dspark.cli report --evals $(EVAL_OUT)

# Engines (issue 4): ONNX graphs + ORT-optimized engines + manifest.json in build/engines
# (incremental). PROFILE=gpu (issue 13) also builds TensorRT plans (PRECISION: fp32, fp16 or both)
# with a timing cache and runs the parity gates on the GPU; it fails where TensorRT or a GPU is missing.
BUCKETS ?= 1,2,4,8,16
MAX_CONTEXT ?= 2048
PROFILE ?= cpu
PRECISION ?= fp32,fp16
engines: setup
	$(PY) -m dspark.cli engines --drafter dspark --out build/engines --buckets $(BUCKETS) --max-context $(MAX_CONTEXT) \
	  --profile $(PROFILE) $(if $(filter gpu,$(PROFILE)),--precision $(PRECISION))

# Serving (issue 5) and performance (issue 6). `make serve` runs until Ctrl-C / SIGTERM.
serve: setup
	@[ -f build/engines/manifest.json ] || $(MAKE) engines
	$(PY) -m dspark.cli serve --engines build/engines

# SPS(B) through perf_analyzer on the target's probe entry → results/sps.json + sps.png
sps: setup
	@[ -f build/engines/manifest.json ] || $(MAKE) engines
	$(PY) -m dspark.cli sps --engines build/engines

# Concurrency × mode sweep of streaming clients → results/bench.{json,csv} + plots
# BENCH_MODES / BENCH_CONCURRENCY (comma lists) narrow or widen the sweep, e.g. issue 18's:
#   make bench BENCH_MODES=off,dspark,dspark-skip BENCH_CONCURRENCY=1,2,4,8,16,32,64
BENCH_TOKENS ?= 64
BENCH_MODES ?=
BENCH_CONCURRENCY ?=
bench: setup
	@[ -f build/engines/manifest.json ] || $(MAKE) engines
	$(PY) -m dspark.cli bench --engines build/engines --max-tokens $(BENCH_TOKENS) \
	  $(if $(BENCH_MODES),--modes $(BENCH_MODES)) $(if $(BENCH_CONCURRENCY),--concurrency $(BENCH_CONCURRENCY))

lint: setup
	$(PY) -m ruff check dspark tests
	$(PY) -m ruff format --check dspark tests
	$(PY) -m mypy dspark/core

clean:
	rm -rf build artifacts .pytest_cache

# Issue 16: two tritonservers on loopback, kill -9 one under 16 concurrent streams; the client's
# endpoint list replays on the other with the same seed (same tokens, none lost, none twice).
replicas-test: setup
	$(PYTEST) -q -s tests/integration/test_replicas.py

# Soak: 32 streaming clients for SOAK_MINUTES (tiny engines, loopback only) mixing modes, sampling,
# stop strings, cancellations and bad requests → results/soak.json + results/soak.png
SOAK_MINUTES ?= 10
soak: setup
	$(PY) -m dspark.perf.soak --minutes $(SOAK_MINUTES) --clients 32 --out results/soak.json

# Kubernetes / KServe manifests for a profile (PROFILE=cpu|gpu) → build/deploy/PROFILE
PROFILE ?= cpu
deploy: setup
	$(PY) -m dspark.cli deploy --profile $(PROFILE)

# The GPU check (issue 13): one run on one NVIDIA GPU, ~8 minutes: plans, parity (non-zero exit on
# a parity failure), the gpu-profile server, SPS sweep and a short bench → results/gpu/. Offline
# machines: wheels in ../gpu-wheels and the SmolLM2 checkpoint beside the checkout (README, "GPU").
gpu-check:
	bash scripts/gpu_check.sh

# What a bare, offline GPU machine with only CUDA PyTorch can check (no TensorRT, tritonserver or
# SmolLM2 weights there): greedy losslessness of the torch runtime on the GPU, step/verify/draft
# timings, CUDA-graph replay → results/gpu-probe/. PY: a Python with CUDA torch (default python3).
gpu-probe:
	PYTHONPATH=. $${PY:-python3} -m dspark.perf.gpu_probe --out results/gpu-probe --prompts 16 --max-tokens 64 \
	  --context 512 --reps 30 --profile
