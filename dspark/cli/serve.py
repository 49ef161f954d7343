"""`dspark serve` and `dspark generate --url`: the server and its streaming client."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path


def add_parsers(sub) -> None:
    s = sub.add_parser("serve", help="render the model repository and run tritonserver on 127.0.0.1")
    s.add_argument("--engines", default="build/engines", help="a `make engines` build folder")
    s.add_argument("--target", default="smollm2-135m-instruct", help="target name or directory (tokenizer)")
    s.add_argument(
        "--drafter",
        default=None,
        help="a drafter (shipped name, our checkpoint, or one made by `dspark import`): build the engines "
        "for --target and it into --engines first (incremental, as `dspark engines`)",
    )
    s.add_argument("--profile", default="cpu", choices=["cpu", "gpu"])
    s.add_argument("--repository", default="build/model_repository")
    s.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    s.add_argument("--http-port", type=int, default=8000)
    s.add_argument("--grpc-port", type=int, default=8001)
    s.add_argument("--metrics-port", type=int, default=8002)
    s.add_argument("--slots", type=int, default=16, help="concurrent sequences (KV / context slots)")
    s.add_argument("--max-len", type=int, default=2048, help="positions per sequence (prompt + answer)")
    s.add_argument("--max-new-tokens", type=int, default=1024)
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--sps", default="results/sps.json", help="SPS(B) table (else a quick startup probe)")
    s.add_argument("--default-mode", default="dspark")
    s.add_argument("--max-queue", type=int, default=64, help="waiting requests before 'busy' errors")
    s.add_argument(
        "--prefill-budget", type=int, default=2048,
        help="prompt tokens admitted (prefilled) per engine step, at least one request; 0 = no limit",
    )  # fmt: skip
    s.add_argument("--render-only", action="store_true", help="render + validate the repository, then exit")
    s.set_defaults(fn=serve)


def serve(args: argparse.Namespace) -> int:
    from dspark.model_repository.render import RenderError, render, validate
    from dspark.serving.launcher import Server, ServerError

    engines = Path(args.engines)
    if args.drafter is not None:
        rc = _build_engines(args)
        if rc:
            return rc
    if not (engines / "manifest.json").exists():
        print(f"error: no engines in {engines}: run `make engines` first", file=sys.stderr)
        return 2
    from dspark.models.loading import has_tokenizer, target_dir

    tdir: Path | None = target_dir(args.target)
    if not has_tokenizer(tdir):
        print(f"[serve] {args.target} has no tokenizer: the server accepts input_ids only")
        tdir = None
    try:
        models = render(
            args.profile,
            Path(args.repository),
            engines,
            tdir,
            num_slots=args.slots,
            max_len=args.max_len,
            threads=args.threads,
            max_new_tokens=args.max_new_tokens,
            default_mode=args.default_mode,
            max_queue=args.max_queue,
            prefill_budget=args.prefill_budget,
            sps_path=str(Path(args.sps).resolve()) if Path(args.sps).exists() else "",
        )
        validate(Path(args.repository), require_files=args.profile == "cpu")
    except RenderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[serve] rendered {args.profile} repository {args.repository}: {', '.join(models)}")
    if args.render_only:
        return 0
    server = Server(
        Path(args.repository).resolve(),
        models,
        args.http_port,
        args.grpc_port,
        args.metrics_port,
        host=args.host,
    )
    try:
        server.start()
    except ServerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(
        f"[serve] ready: gRPC {args.host}:{args.grpc_port}, HTTP {args.host}:{args.http_port}, metrics "
        f"{args.host}:{args.metrics_port}/metrics (log {server.log_path}); Ctrl-C stops it",
        flush=True,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.is_set() and server.alive():
        stop.wait(0.5)
    code = server.stop()
    if not stop.is_set():
        print(f"error: tritonserver exited on its own (code {code}):\n{server.log_tail()}", file=sys.stderr)
        return 1
    print("[serve] stopped")
    return 0


def _build_engines(args: argparse.Namespace) -> int:
    """`dspark serve --target T --drafter D`: the engines of that pair, built (or found up to
    date) by the same code as `dspark engines`, with the serving limits as build settings."""
    from dspark.cli.engines import run as build

    return build(
        argparse.Namespace(
            target=args.target,
            drafter=args.drafter,
            out=args.engines,
            buckets="1,2,4,8,16",
            max_context=args.max_len,
            threads=args.threads,
            no_verify=False,
            int8=False,
        )
    )


def generate_remote(args: argparse.Namespace) -> int:
    """Stream one answer from a running server over gRPC."""
    from dspark.serving.client import ClientError, stream_generate

    try:
        gen = stream_generate(
            args.url,
            text=args.prompt,
            max_tokens=args.max_tokens,
            mode=args.mode,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            on_text=None if args.json else (lambda piece: print(piece, end="", flush=True)),
            timeout=args.timeout,
        )
    except ClientError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if "cannot reach" not in str(e) else 1
    if args.json:
        print(json.dumps({"text": gen.text, "token_ids": gen.token_ids, "stats": gen.stats}))
    else:
        s = gen.stats or {}
        print(
            f"\n[{len(gen.token_ids)} tokens in {gen.seconds:.2f} s, mode={s.get('mode')}, "
            f"τ {s.get('tau') or 0:.2f}]",
            file=sys.stderr,
        )
    return 0


def server_demo(args: argparse.Namespace, prompts: list[tuple[str, str]]) -> int:
    """`make demo`: start tritonserver on free loopback ports with the engines, stream one answer
    per domain in the chosen mode, time the same request with mode=off, stop the server."""
    from dspark.model_repository.render import render, validate
    from dspark.serving.client import ClientError, stream_generate
    from dspark.serving.launcher import Server, ServerError

    engines = Path(args.engines)
    repo = Path("build/demo_repository").resolve()
    sps = Path("results/sps.json")
    models = render(
        "cpu",
        repo,
        engines,
        _target(args.target),
        num_slots=4,
        max_len=2048,
        threads=args.threads,
        sps_path=str(sps.resolve()) if sps.exists() else "",
    )
    validate(repo)
    server = Server.on_free_ports(repo, models)
    print(
        f"[demo] starting tritonserver (models: {', '.join(models)}; log {server.log_path or 'build/logs'})"
    )
    t0 = time.perf_counter()
    try:
        server.start()
    except ServerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    url = f"127.0.0.1:{server.grpc_port}"
    print(
        f"[demo] ready in {time.perf_counter() - t0:.1f} s: gRPC {url}, HTTP 127.0.0.1:{server.http_port}, "
        f"metrics 127.0.0.1:{server.metrics_port}/metrics"
    )
    try:
        # the first request pays the server's one-time startup work (SPS probe without a table)
        stream_generate(url, text="Hi", max_tokens=2, mode=args.mode)
        tot = {"off": [0, 0.0], "spec": [0, 0.0]}
        same_all = True
        for domain, prompt in prompts:
            print(f"\n=== {domain}: {prompt[:100].strip()!r}{'…' if len(prompt) > 100 else ''}", flush=True)
            spec = stream_generate(
                url,
                text=prompt,
                max_tokens=args.max_tokens,
                mode=args.mode,
                on_text=lambda piece: print(piece, end="", flush=True),
            )
            off = stream_generate(url, text=prompt, max_tokens=args.max_tokens, mode="off")
            same = spec.token_ids == off.token_ids
            same_all &= same
            for key, g in (("spec", spec), ("off", off)):
                tot[key][0] += len(g.token_ids)
                tot[key][1] += g.seconds
            st = spec.stats or {}
            print(
                f"\n--- {len(spec.token_ids)} new tokens (greedy) · "
                f"off: {len(off.token_ids) / off.seconds:.1f} tok/s"
                f" · {args.mode}: {len(spec.token_ids) / spec.seconds:.1f} tok/s, τ {st.get('tau') or 0:.2f},"
                f" {off.seconds / spec.seconds:.2f}× off · output "
                + ("identical" if same else "DIFFERENT (a bug: please report)"),
                flush=True,
            )
        n, secs = tot["off"]
        ns, ss = tot["spec"]
        print(
            "\n[demo] through tritonserver (ONNX Runtime engines, one stream at a time): "
            f"off {n / secs:.1f} tok/s; "
            f"{args.mode} {ns / ss:.1f} tok/s = {(ns / ss) / (n / secs):.2f}× off"
            + (", same tokens" if same_all else ", OUTPUTS DIFFER (a bug)")
            + ". Measured just now on this machine (request sent → last token, prefill included)."
        )
        return 0 if same_all else 3
    except ClientError as e:
        print(f"error: {e}\n{server.log_tail()}", file=sys.stderr)
        return 1
    finally:
        code = server.stop()
        print(f"[demo] server stopped (exit code {code})")


def _target(name: str):
    from dspark.models.loading import target_dir

    return target_dir(name)
