"""ONNX Runtime engines vs PyTorch eager, step by step (issue 4's benchmark; not a test).

    .venv/bin/python -m dspark.perf.engine_bench [--engines build/engines] [--context 256] [--repeat 15]

Both sides run through the same runner interface the decoding loop uses (KV slots, cache
writes included), on one sequence with a `--context`-token cache:

* target verify: N new tokens, N ∈ {1, 4, 8, 16, 32}, rolled back after every call;
* drafter round: backbone + γ head steps + sampling (propose) for R ∈ buckets ≤ 16 sequences.

Median of --repeat calls after 3 warm-ups, both sides interleaved in one run so the machine's
state is the same for both. Writes results/engine_bench.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from dspark.core.sampling import SamplingParams
from dspark.engines.ort import OrtDrafterRunner, OrtTargetRunner, session
from dspark.models.block_drafter import BlockDrafterRunner
from dspark.models.loading import load_target
from dspark.models.target import TargetRunner
from dspark.training.pipeline import load_drafter


def timed(fn, repeat: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", default="build/engines")
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="results/engine_bench.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    eng = Path(args.engines)
    loaded = load_target()
    cfg = loaded.model.cfg
    P = args.context
    prompt = [(7 * i) % 5000 + 100 for i in range(P)]
    runners = {
        "pytorch": TargetRunner(loaded.model, 1, P + 64),
        "onnxruntime": OrtTargetRunner(session(eng / "target.opt.onnx", args.threads), cfg, 1, P + 64),
    }
    for r in runners.values():
        r.step([r.allocate()], [prompt])
    rows = []
    for N in (1, 4, 8, 16, 32):
        ms = {}
        for name, r in runners.items():

            def call(r=r, N=N):
                r.step([0], [list(range(200, 200 + N))])
                r.rollback(0, P)

            ms[name] = timed(call, args.repeat)
        rows.append({"what": f"target verify, 1 seq × {N} tokens", "tokens": N, **ms})
        print(f"target N={N}: PyTorch {ms['pytorch']:.1f} ms, ORT {ms['onnxruntime']:.1f} ms", flush=True)
    one_token_ort = rows[0]["onnxruntime"]

    model, _ = load_drafter(args.drafter, loaded)
    meta = json.loads((eng / "drafter_meta.json").read_text())
    feats = torch.randn(P, cfg.feature_size) * 0.5
    for R in [b for b in meta["buckets"] if b <= 16]:
        d_ort = OrtDrafterRunner.load(eng, num_slots=R, threads=args.threads)
        d_pt = BlockDrafterRunner(model, num_slots=R, max_len=P + 64)
        ms = {}
        for name, d in (("pytorch", d_pt), ("onnxruntime", d_ort)):
            for rid in range(R):
                d.begin(rid, prompt, feats)
            gens = [torch.Generator().manual_seed(i) for i in range(R)]
            args_ = (list(range(R)), [prompt[-1]] * R, [SamplingParams()] * R, gens)
            ms[name] = timed(lambda d=d, a=args_: d.propose(*a), args.repeat)
        rows.append(
            {
                "what": f"drafter round, {R} seq (backbone + {model.cfg.block_size} head steps)",
                "batch": R,
                **ms,
            }
        )
        print(f"drafter R={R}: PyTorch {ms['pytorch']:.1f} ms, ORT {ms['onnxruntime']:.1f} ms", flush=True)
    result = {
        "machine": f"{platform.node()} {platform.machine()}, {args.threads} threads",
        "date": time.strftime("%Y-%m-%d"),
        "context": P,
        "rows": rows,
        "drafter_round_b1_over_target_1token": rows[5]["onnxruntime"] / one_token_ort,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print("\n| step | PyTorch ms | ORT ms | speed-up |\n|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['what']} | {r['pytorch']:.1f} | {r['onnxruntime']:.1f} "
            f"| {r['pytorch'] / r['onnxruntime']:.2f}x |"
        )
    share = result["drafter_round_b1_over_target_1token"]
    print(f"\ndrafter round (1 seq, ORT) = {share:.0%} of a 1-token ORT target step")


if __name__ == "__main__":
    main()
