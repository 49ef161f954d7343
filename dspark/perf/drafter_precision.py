"""The drafter's int8 engines against its fp32 ones, from one build folder (`make engines` keeps
both: drafter_meta.json names the int8 files, the fp32 ones sit beside them).

speed       one draft round (`propose`: backbone + the sequential head) per batch bucket, both
            precisions interleaved call by call, median of 20 after 4 warm-ups;
acceptance  every eval set's first prompts, greedy, every draft verified (static:7), through
            the ORT target: mean tokens per round (τ) with each precision, and whether the
            outputs are identical (they must be: the fp32 target decides every token).

    python -m dspark.perf.drafter_precision --engines build/engines [--prompts 6] [--tokens 96]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

SETS = ["gsm8k-test", "humaneval", "mt-bench"]


def runners(build: Path, threads: int, slots: int) -> dict:
    """{"fp32": runner, "int8": runner} over the same build folder."""
    from dspark.engines.ort import OrtDrafterRunner, session

    meta = json.loads((build / "drafter_meta.json").read_text())
    if "int8" not in str(meta.get("drafter_precision", "")):
        raise SystemExit(f"{build} has no int8 drafter: run `make engines` (int8 is the cpu default)")
    out = {}
    for name in ("fp32", "int8"):
        files = {
            role: {
                b: (f if name == "int8" else f.replace(".int8", "")) for b, f in meta["files"][role].items()
            }
            for role in ("drafter_backbone", "drafter_head")
            if role in meta["files"]
        }
        engines: dict = {"drafter_context": session(build / meta["files"]["drafter_context"], threads)}
        for role, per in files.items():
            engines[role] = {int(b): session(build / f, threads) for b, f in per.items()}
        out[name] = OrtDrafterRunner(engines, {**meta, "files": {**meta["files"], **files}}, slots)
    return out


def speed(build: Path, threads: int, buckets: list[int]) -> list[dict]:
    from dspark.core.sampling import SamplingParams

    rs = runners(build, threads, max(buckets))
    F = rs["fp32"].cfg["feature_size"]
    rows = []
    g = torch.Generator().manual_seed(0)
    for B in buckets:
        rids = list(range(B))
        for r in rs.values():
            for rid in rids:
                if rid not in r._slot:
                    r.begin(rid, [], torch.randn(150, F, generator=g))
        gens = [torch.Generator().manual_seed(i) for i in rids]
        times: dict[str, list[float]] = {k: [] for k in rs}
        for _ in range(24):
            feats = torch.randn(B, 1, F, generator=g)
            for name, r in rs.items():
                for rid in rids:
                    r.advance(rid, [], feats[rid])
                t0 = time.perf_counter()
                r.propose(rids, [5] * B, [SamplingParams()] * B, gens)
                times[name].append(time.perf_counter() - t0)
        med = {k: 1e3 * statistics.median(v[4:]) for k, v in times.items()}
        rows.append(
            {"batch": B, "fp32_ms": med["fp32"], "int8_ms": med["int8"], "ratio": med["int8"] / med["fp32"]}
        )
        print(f"[precision] batch {B}: fp32 {med['fp32']:.2f} ms, int8 {med['int8']:.2f} ms", flush=True)
    return rows


def acceptance(build: Path, prompts: int, tokens: int) -> dict:
    from dspark.core.interfaces import Request
    from dspark.core.reference import generate
    from dspark.core.sampling import SamplingParams
    from dspark.core.scheduler import Static
    from dspark.engines.ort import OrtTargetRunner, session
    from dspark.models.loading import load_target
    from dspark.prompts import eval_prompts

    loaded = load_target()
    target = OrtTargetRunner(session(build / "target.opt.onnx", 1), loaded.model.cfg, 1, 2048)
    rs = runners(build, 1, 1)
    out: dict = {}
    for name in SETS:
        texts = eval_prompts(name, prompts)
        per: dict = {}
        for prec, drafter in rs.items():
            reqs = [
                Request(loaded.chat_ids(t), tokens, SamplingParams(), stop_ids=loaded.stop_ids) for t in texts
            ]
            res = [generate(target, [q], drafter, Static(7))[0] for q in reqs]
            accepted = [t.accepted for r in res for t in r.trace if t.verified == 7]
            per[prec] = {
                "tau": 1 + float(np.mean(accepted)),
                "rounds": len(accepted),
                "tokens": [r.tokens for r in res],
            }
        out[name] = {
            "tau_fp32": per["fp32"]["tau"],
            "tau_int8": per["int8"]["tau"],
            "rounds": [per["fp32"]["rounds"], per["int8"]["rounds"]],
            "identical_outputs": per["fp32"]["tokens"] == per["int8"]["tokens"],
        }
        print(
            f"[precision] {name}: τ fp32 {out[name]['tau_fp32']:.3f}, int8 {out[name]['tau_int8']:.3f}",
            flush=True,
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="build/engines")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--buckets", default="1,2,4,8,16")
    ap.add_argument("--prompts", type=int, default=6, help="prompts per eval set")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--out", default="results/drafter_precision.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    build = Path(args.engines)
    t0 = time.time()
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python -m dspark.perf.drafter_precision " + " ".join(argv or []),
        "threads": args.threads,
        "speed": speed(build, args.threads, [int(b) for b in args.buckets.split(",")]),
        "acceptance": acceptance(build, args.prompts, args.tokens),
    }
    result["wall_seconds"] = round(time.time() - t0, 1)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"[precision] wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
