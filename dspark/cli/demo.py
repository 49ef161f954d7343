"""`dspark demo` and in-process `dspark generate`: the product in one command, and one prompt
through the reference loop (PyTorch or the ONNX Runtime engines)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dspark.cli.server_args import add_server_args


def add_parsers(sub) -> None:
    d = sub.add_parser(
        "demo", help="real prompts per domain through tritonserver: off vs dspark vs dspark-skip, same run"
    )
    d.add_argument("--target", default="smollm2-135m-instruct")
    d.add_argument("--max-tokens", type=int, default=128)
    d.add_argument("--per-domain", type=int, default=2, help="prompts per domain (math, code, chat)")
    d.add_argument("--repeats", type=int, default=2, help="runs of every (prompt, mode), order alternating")
    d.add_argument("--modes", default="off,dspark,dspark-skip", help="modes compared (off first)")
    d.add_argument("--threads", type=int, default=2)
    d.add_argument("--drafter", default="dspark", help="shipped drafter name or checkpoint directory")
    d.add_argument(
        "--engines",
        default=None,
        help="serve the ONNX Runtime engines of this build folder with tritonserver (make engines)",
    )
    d.add_argument(
        "--in-process",
        action="store_true",
        help="run in this process (the engines of --engines, else the PyTorch reference loop), no server",
    )
    add_server_args(d)
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


def quick_sps(runner, context: int = 128, sizes=(1, 2, 4, 8, 16), repeats: int = 3):
    """A quick in-process SPS(B) table of `runner` (one sequence, `context` cached tokens)."""
    from dspark.core.sps import measure_sps

    slot = runner.allocate()
    try:
        runner.step([slot], [[(7 * i) % 5000 + 100 for i in range(context)]])

        def step(b: int) -> None:
            runner.step([slot], [list(range(300, 300 + b))])
            runner.rollback(slot, context)

        return measure_sps(
            step, sizes, repeats, {"source": "quick in-process measurement", "context": context}
        )
    finally:
        runner.release(slot)


def _runners(loaded, engines: str | None, drafter_name: str | None, slots: int, max_len: int):
    """(target runner, drafter runner or None, STS or None, label): PyTorch, or the ORT engines
    of `engines` (a `make engines` build folder)."""
    from dspark.models.runners import runner_for
    from dspark.models.target import TargetRunner
    from dspark.training.pipeline import load_drafter

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
    """Every prompt × mode × repeat, order alternating between repeats; then one summary."""
    from dspark.prompts import PromptsError, demo_prompts

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or modes[0] != "off":
        print(
            "error: --modes must start with off (the baseline every ratio is taken against)", file=sys.stderr
        )
        return 2
    try:
        prompts = demo_prompts(args.per_domain)
    except PromptsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.engines and not (Path(args.engines) / "manifest.json").exists():
        print(f"error: no engines in {args.engines}: run `make engines` first", file=sys.stderr)
        return 2
    print(
        f"[demo] {len(prompts)} prompts ({args.per_domain} per domain: math, code, chat) × modes "
        f"{', '.join(modes)} × {args.repeats} repeats, greedy, up to {args.max_tokens} new tokens each"
    )
    if args.engines and not args.in_process:
        from dspark.cli.serve import demo_server

        with demo_server(args) as run:
            records = _demo_runs(run, prompts, modes, args)
        label = "through tritonserver (ONNX Runtime engines)"
    else:
        run, label = _in_process_runner(args)
        records = _demo_runs(run, prompts, modes, args)
    return demo_summary(records, modes, label)


def _demo_runs(run, prompts, modes, args) -> list[dict]:
    """run(prompt, mode, on_text) → (token ids, seconds, stats dict)."""
    records = []
    for rep in range(args.repeats):
        order = modes if rep % 2 == 0 else modes[::-1]
        for p, (domain, prompt) in enumerate(prompts):
            if rep == 0:
                print(f"\n=== {domain}: {prompt[:90].strip()!r}{'…' if len(prompt) > 90 else ''}", flush=True)
            line = []
            for mode in order:
                show = rep == 0 and mode == modes[-1]
                on_text = (lambda piece: print(piece, end="", flush=True)) if show else None
                ids, seconds, stats = run(prompt, mode, on_text)
                records.append(
                    {"prompt": p, "domain": domain, "repeat": rep, "mode": mode, "tokens": ids,
                     "seconds": seconds, "tau": stats.get("tau"), "rounds": stats.get("rounds") or 0,
                     "verified": stats.get("verified_tokens") or 0}
                )  # fmt: skip
                line.append(f"{mode} {len(ids) / seconds:.1f} tok/s")
            print(
                ("\n" if rep == 0 else "") + f"--- {domain} #{p} repeat {rep + 1}: " + " · ".join(line),
                flush=True,
            )
    return records


def demo_summary(records: list[dict], modes: list[str], label: str) -> int:
    """The numbers measured in this run: per mode tok/s, the median ratio to off with its
    spread (over prompt × repeat pairs), τ and mean ℓ; identical tokens checked; and, when
    speculation is not faster, why."""
    import statistics

    ref = {(r["prompt"], r["repeat"]): r for r in records if r["mode"] == "off"}
    same = all(r["tokens"] == ref[(r["prompt"], r["repeat"])]["tokens"] for r in records)
    print(f"\n[demo] {label}, one stream at a time, measured just now on this machine:")
    summary = {}
    for mode in modes:
        rs = [r for r in records if r["mode"] == mode]
        tps = sum(len(r["tokens"]) for r in rs) / sum(r["seconds"] for r in rs)
        ratios = [ref[(r["prompt"], r["repeat"])]["seconds"] / r["seconds"] for r in rs]
        rounds = sum(r["rounds"] for r in rs)
        tau = sum(len(r["tokens"]) for r in rs) / rounds if rounds else float("nan")
        ell = sum(r["verified"] for r in rs) / rounds if rounds else 0.0
        med = statistics.median(ratios)
        summary[mode] = (tps, med, tau, ell)
        if mode == "off":
            print(f"  {mode:<12} {tps:6.1f} tok/s")
        else:
            print(
                f"  {mode:<12} {tps:6.1f} tok/s   {med:.2f}× off (median of {len(ratios)}, spread "
                f"{min(ratios):.2f}–{max(ratios):.2f})   τ {tau:.2f}   mean ℓ {ell:.2f}"
            )
    print("  tokens: " + ("identical in every mode and run" if same else "DIFFERENT (a bug: please report)"))
    spec = [m for m in modes if m != "off"]
    best = max(spec, key=lambda m: summary[m][1]) if spec else None
    if best is not None and summary[best][1] < 1.0:
        tau = summary[spec[0]][2]
        print(
            f"  why not faster: τ {tau:.2f} — the drafter accepts too few tokens per round to pay for "
            "drafting on this CPU (each round adds a draft call, and a verify of ℓ tokens costs more "
            "than one); "
            + ", ".join(f"{m} is {100 * (1 - summary[m][1]):.0f}% slower than off" for m in spec)
        )
    elif best is not None:
        print(f"  fastest: {best} at {summary[best][1]:.2f}× off (median), same tokens as off")
    return 0 if same else 3


def _in_process_runner(args):
    """(run, label) for the in-process demo: the engines of --engines or the PyTorch loop."""
    import torch

    from dspark.core.interfaces import Request
    from dspark.core.reference import generate
    from dspark.core.sampling import SamplingParams
    from dspark.core.scheduler import policy_for
    from dspark.models.loading import load_target

    torch.set_num_threads(args.threads)
    loaded = load_target(args.target)
    target, drafter, sts, label = _runners(loaded, args.engines, args.drafter, 1, 2048)
    sps = quick_sps(target)
    policies: dict = {}

    def run(prompt: str, mode: str, on_text):
        if mode not in policies:
            policies[mode] = policy_for(mode, sps)
        req = Request(loaded.chat_ids(prompt), args.max_tokens, SamplingParams(), stop_ids=loaded.stop_ids)
        t0 = time.perf_counter()
        res = generate(target, [req], drafter if mode != "off" else None, policies[mode], sts)[0]
        seconds = time.perf_counter() - t0
        if on_text is not None:
            on_text(loaded.decode(res.tokens))
        return res.tokens, seconds, res.stats.to_json_dict()

    return run, f"in-process ({label}, SPS(B) measured in-process)"


def cmd_generate(args: argparse.Namespace) -> int:
    if args.url:
        from dspark.cli.serve import generate_remote

        return generate_remote(args)
    import torch

    from dspark.core.sampling import SamplingParams
    from dspark.core.scheduler import check_mode, policy_for
    from dspark.models.loading import load_target

    if not args.prompt.strip():
        print("error: --prompt is empty", file=sys.stderr)
        return 2
    try:
        params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
        check_mode(args.mode)
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
    from dspark.core.interfaces import Request
    from dspark.core.reference import generate

    policy = policy_for(args.mode, quick_sps(target) if args.mode.startswith("dspark") else None)
    req = Request(loaded.chat_ids(args.prompt), args.max_tokens, params, stop_ids=loaded.stop_ids)
    t0 = time.perf_counter()
    res = generate(target, [req], drafter=drafter, policy=policy, calibration=sts)[0]
    dt = time.perf_counter() - t0
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
