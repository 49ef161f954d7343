"""`dspark sps`, `dspark bench` and `dspark gpu-check`: the perf_analyzer SPS(B) sweep, the serving
benchmark, and the one-run GPU check (dspark/perf/gpu_check.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from dspark.cli.server_args import add_server_args, server_settings
from dspark.paths import REPO
from dspark.perf.bench import CONCURRENCY, MODES, bench_prompts, run_bench
from dspark.perf.sps import DEFAULT_CONTEXTS, DEFAULT_SIZES, PerfAnalyzerError, run_sweep


def add_parsers(sub) -> None:
    from dspark.perf import gpu_check

    add_sps_parser(sub)
    add_bench_parser(sub)
    gpu_check.add_parser(sub)


def add_sps_parser(sub) -> None:
    s = sub.add_parser("sps", help="measure the target's SPS(B) curve with perf_analyzer → results/sps.json")
    s.add_argument("--engines", default="build/engines", help="a `make engines` build folder")
    s.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="batch tokens B (comma list)")
    s.add_argument("--contexts", default=",".join(map(str, DEFAULT_CONTEXTS)), help="context lengths L")
    s.add_argument("--out", default="results/sps.json")
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--requests", type=int, default=40, help="requests per perf_analyzer measurement window")
    s.add_argument(
        "--passes", type=int, default=3, help="sweeps over all B (alternating direction); the median is kept"
    )
    add_server_args(s)
    s.set_defaults(fn=cmd_sps)


def cmd_sps(args) -> int:
    engines = Path(args.engines)
    if not (engines / "manifest.json").exists():
        print(f"error: no engines in {engines}: run `make engines` first", file=sys.stderr)
        return 2
    try:
        run_sweep(
            engines,
            [int(x) for x in args.sizes.split(",")],
            [int(x) for x in args.contexts.split(",")],
            Path(args.out),
            args.threads,
            args.requests,
            args.passes,
            server=server_settings(args),
        )
    except PerfAnalyzerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="concurrency × mode sweep of streaming clients → results/bench.json")
    b.add_argument("--engines", default="build/engines", help="a `make engines` build folder")
    b.add_argument(
        "--url", default=None, help="use a running server (gRPC HOST:PORT) instead of starting one"
    )
    b.add_argument("--modes", default=",".join(MODES))
    b.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)))
    b.add_argument("--max-tokens", type=int, default=64)
    b.add_argument(
        "--length-spread", type=float, default=0.5,
        help="each request's max tokens drawn from max-tokens × [1 − S, 1 + S] (the same draw in every "
        "cell): staggers the streams' finishes as real traffic does (0 = all equal, the protocol "
        "before session 17)",
    )  # fmt: skip
    b.add_argument(
        "--min-requests", type=int, default=3, help="requests per cell: max(this, 2 × concurrency)"
    )
    b.add_argument(
        "--time-limit", type=float, default=120.0, help="seconds per cell before no new request starts"
    )
    b.add_argument("--sps", default="results/sps.json", help="SPS table for the server (else a quick probe)")
    b.add_argument("--threads", type=int, default=2)
    b.add_argument(
        "--repeats", type=int, default=2, help="runs per cell (alternating mode order); the median is kept"
    )
    b.add_argument(
        "--prefill-budget", type=int, default=2048, help="the server's prompt tokens per step (0 = no limit)"
    )
    b.add_argument("--out", default="results/bench.json")
    b.add_argument("--max-len", type=int, default=1024, help="the server's positions per sequence")
    add_server_args(b)
    b.set_defaults(fn=cmd_bench)


def cmd_bench(args) -> int:
    import sys

    from dspark.models.loading import target_dir
    from dspark.serving.launcher import ServerError, serving_session

    modes = args.modes.split(",")
    conc = [int(x) for x in args.concurrency.split(",")]
    prompts = bench_prompts(60)
    out = Path(args.out)
    if args.url:
        run_bench(
            args.url, modes, conc, prompts, args.max_tokens, args.min_requests, args.time_limit, out,
            repeats=args.repeats, length_spread=args.length_spread,
        )  # fmt: skip
        return 0
    engines = Path(args.engines)
    if not (engines / "manifest.json").exists():
        print(f"error: no engines in {engines}: run `make engines` first", file=sys.stderr)
        return 2
    sps = Path(args.sps)
    settings = dict(
        num_slots=max(conc), max_len=args.max_len, threads=args.threads, max_queue=4 * max(conc),
        sps_path=str(sps.resolve()) if sps.exists() else "", prefill_budget=args.prefill_budget,
    )  # fmt: skip
    meta = {
        "sps_table": str(sps) if sps.exists() else "quick startup probe",
        "slots": max(conc),
        "threads": args.threads,
        "prefill_budget": args.prefill_budget,
        "engines": str(engines),
        "command": "dspark bench " + " ".join(sys.argv[2:]),
        "cpu_count": os.cpu_count(),
        "server": {k: v for k, v in server_settings(args).items() if v is not None},
    }
    try:
        with serving_session(
            engines, REPO / "build" / "bench_repository", target_dir("smollm2-135m-instruct"),
            log_path=REPO / "build" / "logs" / "bench.log", **settings, **server_settings(args),
        ) as server:  # fmt: skip
            metrics_url = f"http://127.0.0.1:{server.metrics_port}/metrics"
            run_bench(
                f"127.0.0.1:{server.grpc_port}", modes, conc, prompts, args.max_tokens, args.min_requests,
                args.time_limit, out, metrics_url, server.proc.pid, meta, repeats=args.repeats,
                length_spread=args.length_spread,
            )  # fmt: skip
    except ServerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
