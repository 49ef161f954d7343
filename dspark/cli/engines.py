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
    p.add_argument(
        "--drafter-precision",
        default="auto",
        choices=["auto", "int8", "fp32"],
        help="weights of the drafter's backbone and head graphs: int8 (ONNX Runtime dynamic "
        "quantization; still lossless, the fp32 target verifies; 13-18%% faster draft rounds here), fp32, "
        "or auto = int8 for the cpu profile and fp32 for the gpu profile (TensorRT and CUDA run fp32 graphs)",
    )
    g = p.add_argument_group("gpu profile (TensorRT plans + parity on the GPU)")
    g.add_argument(
        "--profile", default="cpu", choices=["cpu", "gpu"], help="gpu: also TensorRT plans + GPU gates"
    )
    g.add_argument("--precision", default="fp32,fp16", help="plan precisions (comma list of fp32, fp16)")
    g.add_argument("--device", default="cuda:0")
    g.add_argument("--max-rows", type=int, default=32, help="sequences per decode step the target plan holds")
    g.add_argument("--max-len", type=int, default=2048, help="positions per sequence the target plan holds")
    g.add_argument(
        "--prefill-tokens", type=int, default=1024, help="prompt tokens per row in one prefill call"
    )
    g.add_argument("--parity-prompts", type=int, default=6, help="real prompts in the greedy gate")
    g.add_argument(
        "--parity-tokens", type=int, default=48, help="tokens generated per prompt in the greedy gate"
    )
    g.add_argument(
        "--no-ort-cuda", action="store_true", help="skip ONNX Runtime's CUDA provider in the gates"
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
    profile = getattr(args, "profile", "cpu")  # callers that build a Namespace by hand: the cpu build
    precisions = [x for x in getattr(args, "precision", "fp32").split(",") if x]
    if profile == "gpu":
        from dspark.engines.gpu_build import gpu_ready

        ok, why = gpu_ready()
        if not ok:
            print(f"error: make engines PROFILE=gpu builds TensorRT plans on a GPU: {why}", file=sys.stderr)
            return 2
        if not precisions or set(precisions) - {"fp32", "fp16"}:
            print(f"error: --precision wants fp32, fp16 or both, got {args.precision!r}", file=sys.stderr)
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
    precision = getattr(args, "drafter_precision", "fp32")  # a hand-made Namespace: fp32
    if precision == "auto":
        precision = "fp32" if profile == "gpu" else "int8"
    if precision == "int8":
        if profile == "gpu":
            print(
                "error: --drafter-precision int8 is for the cpu profile (GPU runtimes run fp32 graphs)",
                file=sys.stderr,
            )
            return 2
        from dspark.engines.build import build_int8_drafter

        build_int8_drafter(b)
    parity_ok = True
    if profile == "gpu":
        from dspark.engines.gpu_build import build_gpu
        from dspark.engines.tensorrt import PlanSettings
        from dspark.prompts import demo_prompts

        meta = json.loads((b.out / "drafter_meta.json").read_text())
        settings = PlanSettings(
            max_rows=args.max_rows,
            prefill_tokens=args.prefill_tokens,
            max_len=args.max_len,
            max_context=args.max_context,
            context_buckets=meta["context_buckets"],
        )
        per = -(-args.parity_prompts // 3)
        texts = [t for _, t in demo_prompts(per)][: args.parity_prompts]
        room = min(args.prefill_tokens, args.max_len - args.parity_tokens - 16)  # what the plans hold
        prompts = [loaded.chat_ids(t)[-room:] for t in texts]
        summary = build_gpu(
            b, loaded.model, drafter, settings, precisions, prompts, args.device, args.parity_tokens,
            ort_cuda=not args.no_ort_cuda,
        )  # fmt: skip
        parity_ok = summary["ok"]
        verdict = "ok" if parity_ok else "FAILED"
        print(f"[engines] parity on the GPU: {verdict} (details: {b.out / 'parity.json'})")
    else:
        ok, why = tensorrt_status()
        note = why if not ok else "not requested (make engines PROFILE=gpu builds them)"
        print(f"[engines] TensorRT plans: skipped — {note}. The ONNX Runtime CPU engines above are complete.")
    man = b.write_manifest({"target": args.target, "drafter": str(args.drafter)})
    engines = json.loads(man.read_text())["engines"]
    print(f"[engines] {len(engines)} engines in {args.out} ({time.time() - t0:.0f} s); manifest: {man}")
    for e in engines:
        print(f"  {e['role']:<17} {e.get('optimized_file', e['file']):<32} {json.dumps(e['shape'])}")
    return 0 if parity_ok else 1
