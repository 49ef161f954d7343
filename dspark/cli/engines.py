"""`dspark engines`: build (incrementally) and verify every engine the Triton repository serves."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("engines", help="export ONNX graphs and build verified engines (+ manifest.json)")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--drafter", default="dspark", help="shipped drafter name or checkpoint directory")
    p.add_argument("--out", default="build/engines")
    p.add_argument("--buckets", default="1,2,4,8,16", help="drafter batch buckets (comma-separated)")
    p.add_argument("--max-context", type=int, default=2048, help="drafter context positions per sequence")
    p.add_argument("--threads", type=int, default=2, help="ORT intra-op threads (recorded in the manifest)")
    p.add_argument("--no-verify", action="store_true", help="skip the PyTorch/polygraphy comparisons")
    p.add_argument(
        "--int8", action="store_true", help="also build a dynamic-int8 target (a different target: see docs)"
    )
    p.set_defaults(fn=run)


def _buckets(text: str) -> list[int]:
    try:
        b = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        b = []
    if not b or b[0] < 1:
        raise SystemExit(f"error: --buckets wants positive integers like 1,2,4,8,16, got {text!r}")
    return b


def run(args: argparse.Namespace) -> int:
    import torch

    from dspark.engines.build import (
        BuildConfig,
        Builder,
        build_drafter,
        build_target,
        sha256_tensors,
        tensorrt_status,
    )
    from dspark.models.loading import load_target
    from dspark.training.pipeline import load_drafter

    for mod in ("onnx", "onnxruntime", "polygraphy"):
        try:
            __import__(mod)
        except ImportError:
            print(f"error: the {mod} package is missing: run `make setup`", file=sys.stderr)
            return 2
    torch.set_num_threads(args.threads)
    cfg = BuildConfig(
        buckets=_buckets(args.buckets),
        max_context=args.max_context,
        threads=args.threads,
        verify=not args.no_verify,
    )
    t0 = time.time()
    loaded = load_target(args.target)
    try:
        drafter, sts = load_drafter(args.drafter, loaded)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if getattr(drafter.cfg, "kind", "") == "eagle3":
        print("error: the EAGLE-3 baseline is an offline baseline and has no serving graphs", file=sys.stderr)
        return 2
    b = Builder(Path(args.out), cfg)
    build_target(b, loaded.model, sha256_tensors(loaded.model))
    build_drafter(
        b,
        drafter,
        sha256_tensors(drafter),
        {"drafter": str(args.drafter), "sts": sts.to_dict() if sts is not None else None},
    )
    if args.int8:
        from dspark.engines.build import build_int8_target

        build_int8_target(b)
    ok, why = tensorrt_status()
    if not ok:
        print(f"[engines] TensorRT plans: skipped — {why}. The ONNX Runtime CPU engines above are complete.")
    else:
        print("[engines] TensorRT is present, but plan builds are not wired up yet: see docs/decisions.md")
    man = b.write_manifest({"target": args.target, "drafter": str(args.drafter)})
    engines = json.loads(man.read_text())["engines"]
    print(f"[engines] {len(engines)} engines in {args.out} ({time.time() - t0:.0f} s); manifest: {man}")
    for e in engines:
        print(f"  {e['role']:<17} {e['optimized_file']:<32} {json.dumps(e['shape'])}")
    return 0
