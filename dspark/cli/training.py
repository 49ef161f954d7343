"""`dspark data | train | eval | report`: the drafter pipeline (regenerated answers → target cache →
training runs → acceptance evaluation)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dspark.paths import shared_dir


def add_parsers(sub) -> None:
    dd = sub.add_parser("data", help="the target regenerates answers to the training prompts (resumable)")
    dd.add_argument("--target", default="smollm2-135m-instruct")
    dd.add_argument("--out", default="artifacts/data/answers.jsonl")
    dd.add_argument("--cache", default="artifacts/cache", help="target cache folder ('' to skip)")
    dd.add_argument(
        "--seed-from",
        default="data/regenerated/answers.jsonl.gz",
        help="committed answers to start from when --out does not exist yet",
    )
    dd.add_argument("--batch", type=int, default=32)
    dd.add_argument("--max-new-tokens", type=int, default=256)
    dd.add_argument("--max-prompt-tokens", type=int, default=768)
    dd.add_argument("--limit", type=int, default=None, help="stop after this many answers in total")
    dd.add_argument("--threads", type=int, default=2)
    dd.add_argument(
        "--no-generate",
        action="store_true",
        help="only unpack the committed answers and rebuild their target cache; generate nothing new",
    )
    dd.add_argument(
        "--reverse",
        action="store_true",
        help="build the target cache from the last answer backwards (a second builder on the same "
        "--cache, one thread each, meets the first in the middle)",
    )
    dd.add_argument(
        "--shuffle",
        type=int,
        default=None,
        metavar="SEED",
        help="build the target cache in a seeded random order: stopped part-way, the cache is a uniform "
        "sample of the answers (a stage on a partial cache keeps the data mix)",
    )
    dd.add_argument(
        "--new-only",
        action="store_true",
        help="generate without first rebuilding the cache of the answers already there (new answers "
        "still write theirs): generation side by side with a `--no-generate` cache builder",
    )
    dd.add_argument(
        "--engines",
        default=None,
        help="generate and rebuild the target cache on the ONNX Runtime target engine of this build "
        "folder (make engines) instead of the PyTorch model",
    )
    dd.add_argument(
        "--pools",
        default="original",
        help="original: the three first pools; all: every pool in train_prompts, balanced over "
        "math / code / chat; or pool names, comma-separated (e.g. arena-hard-v2)",
    )
    dd.add_argument(
        "--extra-samples",
        type=int,
        default=0,
        metavar="N",
        help="then N more answers per prompt of --pools (keys POOL/INDEX~K, their own seeds), drawn at "
        "--extra-temperature: more data where a pool has run out of prompts",
    )
    dd.add_argument(
        "--extra-temperature",
        type=float,
        default=1.0,
        help="temperature of the extra answers (top-p 1: the target's own distribution at T = 1)",
    )
    dd.add_argument(
        "--snapshot",
        default=None,
        metavar="GZ",
        help="write the complete answers of --out (a running job's too) to this gzip snapshot, e.g. "
        "data/regenerated/answers.jsonl.gz, and exit",
    )
    dd.add_argument(
        "--references",
        default=None,
        metavar="JSONL",
        help="instead of generating: write the large pools' reference answers to JSONL and build their "
        "target cache (teacher-forced corpus; --cache defaults to artifacts/cache-ref)",
    )
    dd.set_defaults(fn=cmd_data)

    t = sub.add_parser("train", help="train a drafter on the target cache (resumable) and ship it")
    t.add_argument("--kind", choices=["dspark", "dspark-rnn", "dflash", "eagle3"], default="dspark")
    t.add_argument("--target", default="smollm2-135m-instruct")
    t.add_argument("--answers", default="artifacts/data/answers.jsonl")
    t.add_argument("--cache", default="artifacts/cache")
    t.add_argument("--out", default=None, help="run folder (default artifacts/runs/KIND)")
    t.add_argument("--ship", default=None, help="where the final drafter goes (default drafters/KIND)")
    t.add_argument("--steps", type=int, default=600)
    t.add_argument("--until", type=int, default=None, help="stop after this many steps (resume later)")
    t.add_argument("--seqs-per-step", type=int, default=2, help="cached samples per optimizer step")
    t.add_argument(
        "--anchors", type=int, default=128,
        help="anchors (blocks) per sequence (128 amortises the context projection best on a CPU)",
    )  # fmt: skip
    t.add_argument(
        "--data-mix", default="on-policy", choices=["on-policy", "reference", "mix"],
        help="on-policy: the target's regenerated answers; reference: the teacher-forced corpus; mix: both",
    )  # fmt: skip
    t.add_argument("--references", default="artifacts/data/references.jsonl", help="teacher-forced corpus")
    t.add_argument(
        "--init-from", default=None,
        help="start from this drafter (shipped name or checkpoint folder, fp16 is fine) and its vocabulary",
    )  # fmt: skip
    t.add_argument(
        "--grow-vocab", type=int, default=None, metavar="N",
        help="with --init-from: grow its draft vocabulary to N tokens (every token it has, then the most "
        "frequent answer tokens); new tokens start from its 'outside the vocabulary' rows",
    )  # fmt: skip
    t.add_argument("--ref-cache", default="artifacts/cache-ref", help="its target cache")
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--vocab-size", type=int, default=8192, help="draft vocabulary size")
    t.add_argument(
        "--layers", type=int, default=None,
        help="draft layers (default 2; eagle3: 1); with --init-from: deepen its drafter to this many, the "
        "new layers on top starting as the identity (copies of its top layer, output projections at zero), "
        "or truncate it to its bottom N layers",
    )  # fmt: skip
    t.add_argument("--log-every", type=int, default=10)
    t.add_argument("--ckpt-every", type=int, default=50)
    t.add_argument(
        "--sts-prompts", type=int, default=None,
        help="DSpark: held-out prompts whose speculative rollouts the STS is fitted on, the first half at "
        "T = 1, the second greedy (default 240, ~11 min at one thread per 120; 0: no STS)",
    )  # fmt: skip
    t.add_argument("--sts-tokens", type=int, default=128)
    t.add_argument("--threads", type=int, default=2)
    t.set_defaults(fn=cmd_train)

    e = sub.add_parser("eval", help="offline acceptance: fixed γ chain drafting over a {turns} JSONL file")
    e.add_argument(
        "--drafter", required=True, help="a checkpoint directory or a shipped name: dspark, dflash, eagle3"
    )
    e.add_argument("--data", required=True)
    e.add_argument("--target", default="smollm2-135m-instruct")
    e.add_argument("--limit", type=int, default=None)
    e.add_argument("--max-new-tokens", type=int, default=256)
    e.add_argument("--temperature", type=float, default=0.0)
    e.add_argument("--seed", type=int, default=980406)
    e.add_argument("--batch", type=int, default=4)
    e.add_argument("--threads", type=int, default=2)
    e.add_argument("--json", default=None, help="write the full result JSON here")
    e.add_argument("--engines", default=None, help="verify with the ORT target engine of this build (faster)")
    e.set_defaults(fn=cmd_eval)

    rp = sub.add_parser("report", help="τ / ECE tables and plots from eval JSON files")
    rp.add_argument("--evals", default="artifacts/eval")
    rp.add_argument("--drafters", default="drafters")
    rp.add_argument("--out", default="docs/acceptance")
    rp.set_defaults(fn=cmd_report)


def cmd_data(args: argparse.Namespace) -> int:
    import torch

    from dspark.models.loading import load_target
    from dspark.training.data import TRAIN_POOLS, interleave, read_prompts, regenerate

    if args.snapshot:
        from dspark.training.data import write_snapshot

        counts = write_snapshot(Path(args.out), Path(args.snapshot))
        size = Path(args.snapshot).stat().st_size / 1e6
        per_pool = ", ".join(f"{p} {n}" for p, n in sorted(counts.items(), key=lambda kv: -kv[1]))
        print(f"[data] {sum(counts.values())} answers ({per_pool}) → {args.snapshot} ({size:.2f} MB)")
        return 0
    if args.reverse and args.shuffle is not None:
        print("error: --reverse and --shuffle are two cache-rebuild orders: pick one", file=sys.stderr)
        return 2
    if args.new_only and args.no_generate:
        print("error: --new-only generates; --no-generate only rebuilds the cache", file=sys.stderr)
        return 2
    if args.extra_samples < 0 or not 0 < args.extra_temperature <= 2:
        print("error: --extra-samples must be ≥ 0 and --extra-temperature in (0, 2]", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    src = shared_dir() / "data" / "train_prompts"
    missing = [p for p in TRAIN_POOLS if not (src / f"{p}.jsonl").exists()]
    if missing:
        print(f"error: training prompts {missing} not found in {src} (set DSPARK_SHARED)", file=sys.stderr)
        return 2
    prompts = interleave([read_prompts(src / f"{p}.jsonl") for p in TRAIN_POOLS])
    if args.pools != "original":
        from dspark.training.data import LARGE_POOLS, balanced

        known = [p for p in (*TRAIN_POOLS, *LARGE_POOLS) if (src / f"{p}.jsonl").exists()]
        pools = known if args.pools == "all" else [p.strip() for p in args.pools.split(",") if p.strip()]
        unknown = [p for p in pools if p not in known]
        if unknown or not pools:
            print(
                f"error: --pools {args.pools!r}: unknown pools {unknown}; use original, all or names from "
                f"{', '.join(known)}",
                file=sys.stderr,
            )
            return 2
        prompts = balanced([q for p in pools for q in read_prompts(src / f"{p}.jsonl")])
    loaded = load_target(args.target)
    if args.references:
        cache = "artifacts/cache-ref" if args.cache in ("", "artifacts/cache") else args.cache
        return _reference_corpus(loaded, src, Path(args.references), Path(cache))
    out, seed_from = Path(args.out), Path(args.seed_from) if args.seed_from else None
    if seed_from is not None and seed_from.exists() and not out.exists():
        import gzip
        import shutil

        out.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(seed_from, "rb") as src_f, out.open("wb") as dst_f:
            shutil.copyfileobj(src_f, dst_f)
        print(f"[data] starting from the committed answers in {seed_from}")
    make_runner = None  # (slots, max_len) -> target runner; None: the PyTorch model
    if args.engines:
        from dspark.engines.ort import OrtTargetRunner, session

        onnx = Path(args.engines) / "target.opt.onnx"
        if not onnx.exists():
            print(f"error: no target engine in {args.engines}: run `make engines` first", file=sys.stderr)
            return 2

        def make_runner(slots: int, max_len: int):
            return OrtTargetRunner(session(onnx, args.threads), loaded.model.cfg, slots, max_len)

    if args.cache and not args.new_only:
        from dspark.training.data import build_cache

        one_slot = (lambda max_len: make_runner(1, max_len)) if make_runner else None
        n = build_cache(
            loaded, out, Path(args.cache), reverse=args.reverse, make_runner=one_slot, shuffle=args.shuffle
        )
        if n:
            print(f"[data] rebuilt the target cache for {n} committed answers")
    if args.no_generate:
        print("[data] --no-generate: using the answers already there (run `make data` to generate the rest)")
        return 0
    runner = None
    if make_runner is not None:
        runner = make_runner(args.batch, args.max_prompt_tokens + args.max_new_tokens + 1)
    common = dict(
        cache_dir=Path(args.cache) if args.cache else None,
        batch=args.batch,
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        limit=args.limit,
        runner=runner,
    )
    regenerate(loaded, prompts, Path(args.out), **common)
    if args.extra_samples:
        from dspark.core.sampling import SamplingParams
        from dspark.training.data import extra_samples

        extra = extra_samples(prompts, args.extra_samples)
        print(f"[data] {args.extra_samples} extra answers per prompt at T={args.extra_temperature}")
        params = SamplingParams(temperature=args.extra_temperature, top_p=1.0)
        regenerate(loaded, extra, Path(args.out), params=params, **common)
    return 0


def _reference_corpus(loaded, src: Path, out: Path, cache: Path) -> int:
    """Teacher-forced corpus (issue 12): the large pools' `reference` answers as answer records,
    then their target cache (one prefill pass each, no generation)."""
    from dspark.training.data import LARGE_POOLS, balanced, build_cache, read_answers, reference_records

    missing = [p for p in LARGE_POOLS if not (src / f"{p}.jsonl").exists()]
    if missing:
        print(f"error: pools {missing} not found in {src} (set DSPARK_SHARED)", file=sys.stderr)
        return 2
    if not out.exists():
        recs = [r for p in LARGE_POOLS for r in reference_records(loaded, src / f"{p}.jsonl")]
        order = {(p.pool, p.index): i for i, p in enumerate(balanced(_as_prompts(recs)))}
        recs.sort(key=lambda r: order[(r["pool"], r["index"])])
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        with tmp.open("w") as f:
            for r in recs:
                f.write(json.dumps(r) + "\n")
        tmp.rename(out)
    n = sum(1 for _ in read_answers(out))
    print(
        f"[data] teacher-forced corpus: {n} reference answers in {out}; target cache in {cache}", flush=True
    )
    build_cache(loaded, out, cache)
    return 0


def _as_prompts(recs: list[dict]):
    from dspark.training.data import Prompt

    return [Prompt(r["pool"], r["index"], "") for r in recs]


def cmd_train(args: argparse.Namespace) -> int:
    import torch

    from dspark.models.loading import load_target
    from dspark.training.pipeline import SHIPPED, run_training
    from dspark.training.train import TrainConfig

    torch.set_num_threads(args.threads)
    loaded = load_target(args.target)
    tc = TrainConfig(
        steps=args.steps,
        seqs_per_step=args.seqs_per_step,
        anchors_per_seq=args.anchors,
        lr=args.lr,
        log_every=args.log_every,
        ckpt_every=args.ckpt_every,
    )
    out = Path(args.out or f"artifacts/runs/{args.kind}")
    res = run_training(
        loaded,
        args.kind,
        Path(args.answers),
        Path(args.cache),
        out,
        tc,
        args.vocab_size,
        args.layers,
        until=args.until,
        mix=args.data_mix,
        references=Path(args.references) if args.references else None,
        ref_cache=Path(args.ref_cache) if args.ref_cache else None,
        init_from=Path(args.init_from) if args.init_from else None,
        grow_vocab=args.grow_vocab,
    )
    model, summary = res["model"], res["summary"]
    if summary["steps"] < tc.steps:
        print(f"[train] stopped at step {summary['steps']}/{tc.steps}; run the same command again to resume")
        return 0
    extra = {"summary": {k: v for k, v in summary.items() if k != "history"}, "history": summary["history"]}
    from dspark.training.evaluate import STS_PROMPTS, fit_sts_on_traces, sts_rollouts, sts_slices

    sts_prompts = STS_PROMPTS if args.sts_prompts is None else args.sts_prompts
    if model.cfg.kind == "dspark" and res["held"] and sts_prompts > 0:
        traces = []
        for start, n, temp in sts_slices(sts_prompts):
            print(f"[train] STS rollouts: held-out prompts {start}–{start + n} at T={temp:g}", flush=True)
            traces += sts_rollouts(loaded, model, res["held"], start, n, temp, args.sts_tokens)
        extra["sts"] = fit_sts_on_traces(traces, model.cfg.block_size).to_dict()
    dest = Path(args.ship) if args.ship else SHIPPED / args.kind
    model.save(dest, extra=extra)
    print(f"[train] saved {dest} ({sum(f.stat().st_size for f in dest.iterdir()) / 1e6:.1f} MB)")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    import torch

    from dspark.models.loading import load_target
    from dspark.models.runners import runner_for
    from dspark.training.evaluate import EvalConfig, evaluate, read_first_turns
    from dspark.training.pipeline import load_drafter

    torch.set_num_threads(args.threads)
    loaded = load_target(args.target)
    try:
        model, sts = load_drafter(args.drafter, loaded)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = EvalConfig(
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        batch=args.batch,
    )
    prompts = read_first_turns(Path(args.data), cfg.limit, cfg.seed)
    factory = None
    if args.engines and (Path(args.engines) / "target.opt.onnx").exists():
        from dspark.engines.ort import OrtTargetRunner, session

        sess = session(Path(args.engines) / "target.opt.onnx", args.threads)
        factory = lambda slots, max_len: OrtTargetRunner(sess, loaded.model.cfg, slots, max_len)  # noqa: E731
        print(f"[eval] target: ONNX Runtime engine {args.engines}/target.opt.onnx")
    with torch.no_grad():
        out, arrays = evaluate(
            loaded, runner_for(model, cfg.batch, 4096), prompts, cfg, sts, target_factory=factory
        )
    out["target_runtime"] = "onnxruntime" if factory else "pytorch"
    out.update(drafter=args.drafter, data=str(args.data), kind=model.cfg.kind)
    if args.json:
        import numpy as np

        dest = Path(args.json)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(json.dumps(out, indent=2))
        np.savez(dest.with_suffix(".rounds.npz"), **arrays)  # for reliability plots
    print(
        f"{Path(args.data).stem}: τ {out['tau']:.3f} over {out['rounds']} rounds, "
        f"{out['new_tokens']} new tokens"
        + (
            f", ECE raw {out['ece_raw']:.3f} → STS {out['ece_sts']:.3f}"
            if out.get("ece_sts") is not None
            else ""
        )
    )
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    import numpy as np

    from dspark.core.calibration import STS
    from dspark.training.report import (
        ece_table,
        load_evals,
        plot_conditional,
        plot_reliability,
        plot_training,
        tau_table,
    )

    evals = load_evals(Path(args.evals))
    if not evals:
        print(f"error: no eval JSON in {args.evals}: run `make eval` first", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot_conditional(evals, out / "conditional_acceptance.png")
    drafters = sorted(p for p in Path(args.drafters).glob("*") if (p / "drafter.json").exists())
    plot_training(drafters, out / "training_curves.png")
    for d in drafters:
        meta = json.loads((d / "drafter.json").read_text())
        rounds = sorted(Path(args.evals).glob(f"{d.name}-*-T1.rounds.npz"))
        if meta.get("sts") and rounds:
            z = [np.load(r) for r in rounds]
            plot_reliability(
                np.concatenate([a["logits"] for a in z]),
                np.concatenate([a["accepted"] for a in z]),
                np.concatenate([a["verified" if "verified" in a else "proposed"] for a in z]),
                STS.from_dict(meta["sts"]),
                out / f"reliability_{d.name}.png",
            )
    (out / "acceptance.md").write_text(
        "## τ (bonus token included)\n\n"
        + tau_table(evals)
        + "\n\n## Calibration of prefix survival\n\n"
        + ece_table(evals)
        + "\n"
    )
    print(f"[report] wrote {out}/acceptance.md and plots")
    return 0
