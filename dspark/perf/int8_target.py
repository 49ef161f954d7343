"""The optional int8 target engine: speed and greedy agreement with the fp32 target.

    .venv/bin/python -m dspark.cli engines --int8      # builds build/engines/target.int8.onnx
    .venv/bin/python -m dspark.perf.int8_target [--prompts 6] [--tokens 64]

Speed: one sequence, 256 cached tokens, verify steps of 1 and 8 tokens (median of 15 after 3
warm-ups), fp32 and int8 engines interleaved in one run. Agreement: greedy target-only
generation for the first --prompts prompts of each eval set; reports the share of generated
tokens equal to fp32's before the first divergence and how many answers are identical.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from dspark.core.interfaces import Request
from dspark.core.reference import generate
from dspark.engines.ort import OrtTargetRunner, session
from dspark.models.loading import load_target
from dspark.perf.engine_bench import timed
from dspark.prompts import eval_prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", default="build/engines")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default="results/int8_target.json")
    args = ap.parse_args()
    eng = Path(args.engines)
    if not (eng / "target.int8.onnx").exists():
        raise SystemExit(
            f"no {eng}/target.int8.onnx: run `.venv/bin/python -m dspark.cli engines --int8` first"
        )
    loaded = load_target()
    cfg = loaded.model.cfg
    files = {"fp32": "target.opt.onnx", "int8": "target.int8.onnx"}
    runners = {k: OrtTargetRunner(session(eng / f), cfg, 4, 2048) for k, f in files.items()}
    ctx = [(7 * i) % 5000 + 100 for i in range(256)]
    speed = {}
    for r in runners.values():
        r.step([r.allocate()], [ctx])
    for n in (1, 8):
        for k, r in runners.items():

            def call(r=r, n=n):
                r.step([0], [list(range(300, 300 + n))])
                r.rollback(0, 256)

            speed[f"{k}_verify{n}_ms"] = timed(call, 15)
    for r in runners.values():
        r.release(0)
    prompts = []
    for name in ("gsm8k-test", "humaneval", "mt-bench"):
        prompts += eval_prompts(name, args.prompts)
    reqs = [Request(loaded.chat_ids(p), args.tokens, stop_ids=loaded.stop_ids) for p in prompts]
    outs = {}
    for k, r in runners.items():
        outs[k] = []
        for i in range(0, len(reqs), 4):
            outs[k] += [x.tokens for x in generate(r, reqs[i : i + 4])]
    prefix, total, same = 0, 0, 0
    for a, b in zip(outs["fp32"], outs["int8"]):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix += n
        total += len(a)
        same += a == b
    result = {
        "machine": f"{platform.node()} {platform.machine()}",
        "date": time.strftime("%Y-%m-%d"),
        **speed,
        "answers": len(reqs),
        "identical_answers": same,
        "tokens_before_first_divergence_share": prefix / total,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
