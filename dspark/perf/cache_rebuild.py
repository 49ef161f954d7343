"""The target-cache rebuild (issue 12), per runner: seconds per sample and what each stores.

    .venv/bin/python -m dspark.perf.cache_rebuild --samples 12 --threads 1 [--engines build/engines]

Every fresh machine rebuilds the training cache from the committed answers (one target forward
over prompt + answer per sample: tapped features, final hidden state, full-vocabulary
logsumexp), so its speed decides how much of the data a session can train on. This times
`training.data.build_cache` on the same answers (every k-th of artifacts/data/answers.jsonl)
with the PyTorch target in fp32 (the reference), the ORT target engine (`--engines`) and the
PyTorch target cast to bfloat16 (`--bf16`: measured, not used — see the error columns), and
compares each cache with the fp32 one: the relative error of the features and the final hidden
state, and the largest logsumexp difference at the answer positions the loss reads. Each runner
is timed after one untimed warm-up sample; nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def _errors(ref: Path, other: Path) -> dict[str, float]:
    feats, hidden, lse = [], [], []
    for f in sorted(ref.glob("*.npz")):
        a, b = np.load(f), np.load(other / f.name)
        assert (a["tokens"] == b["tokens"]).all(), f.name
        p = int(a["prompt_len"])  # the loss reads last_hidden and lse at answer positions only
        rel = lambda x, y: float(np.linalg.norm(x - y) / np.linalg.norm(x))  # noqa: E731
        feats.append(rel(a["features"].astype(np.float32), b["features"].astype(np.float32)))
        hidden.append(rel(a["last_hidden"][p:].astype(np.float32), b["last_hidden"][p:].astype(np.float32)))
        lse.append(float(np.abs(a["lse"][p:] - b["lse"][p:]).max()))
    return {"features_rel": max(feats), "hidden_rel": max(hidden), "lse_max_abs": max(lse)}


def main(argv: list[str] | None = None) -> int:
    from dspark.models.loading import load_target
    from dspark.models.target import TargetRunner
    from dspark.training.data import build_cache, read_answers

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--answers", default="artifacts/data/answers.jsonl")
    ap.add_argument("--samples", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--engines", default=None, help="build folder with target.opt.onnx (make engines)")
    ap.add_argument("--bf16", action="store_true", help="also time the PyTorch target cast to bfloat16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    answers = list(read_answers(Path(args.answers)))
    if not answers:
        print(f"error: no answers in {args.answers}: `dspark data --no-generate --cache ''` unpacks them")
        return 2
    picked = answers[:: max(1, len(answers) // (args.samples + 1))][: args.samples + 1]
    loaded = load_target()
    runners = {"torch-fp32": None}
    if args.engines:
        from dspark.engines.ort import OrtTargetRunner, session

        onnx = Path(args.engines) / "target.opt.onnx"
        runners["ort-fp32"] = lambda n: OrtTargetRunner(session(onnx, args.threads), loaded.model.cfg, 1, n)
    if args.bf16:
        bf16 = copy.deepcopy(loaded.model).to(torch.bfloat16)
        runners["torch-bf16"] = lambda n: TargetRunner(bf16, num_slots=1, max_len=n)
    tokens = sum(len(a["prompt_ids"]) + len(a["answer_ids"]) for a in picked[1:])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        warm, timed = Path(tmp) / "warm.jsonl", Path(tmp) / "timed.jsonl"
        warm.write_text(json.dumps(picked[0]) + "\n")
        timed.write_text("".join(json.dumps(a) + "\n" for a in picked[1:]))
        for name, make in runners.items():
            build_cache(loaded, warm, Path(tmp) / f"warm-{name}", make_runner=make)
            t = time.perf_counter()
            build_cache(loaded, timed, Path(tmp) / name, make_runner=make)
            dt = time.perf_counter() - t
            row = {"runner": name, "s_per_sample": dt / args.samples, "tok_per_s": tokens / dt}
            if name != "torch-fp32":
                row.update(_errors(Path(tmp) / "torch-fp32", Path(tmp) / name))
            rows.append(row)
    base = rows[0]["s_per_sample"]
    per = tokens / args.samples
    print(f"{args.samples} samples, {tokens} tokens ({per:.0f} a sample), {args.threads} thread(s)")
    print("| runner | s / sample | tok/s | × torch-fp32 | features rel | hidden rel | lse max abs |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [f"{r['s_per_sample']:.2f}", f"{r['tok_per_s']:.0f}", f"{base / r['s_per_sample']:.2f}"]
        cells += [f"{r[k]:.2g}" if k in r else "—" for k in ("features_rel", "hidden_rel", "lse_max_abs")]
        print(f"| {r['runner']} | " + " | ".join(cells) + " |")
    if args.json:
        out = {"samples": args.samples, "tokens": tokens, "threads": args.threads, "rows": rows}
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
