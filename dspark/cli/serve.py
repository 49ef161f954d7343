"""`dspark serve` and `dspark generate --url`: the server and its streaming client."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from dspark.paths import REPO


def add_parsers(sub) -> None:
    s = sub.add_parser("serve", help="render the model repository and run tritonserver on 127.0.0.1")
    s.add_argument("--engines", default="build/engines", help="a `make engines` build folder")
    s.add_argument("--target", default="smollm2-135m-instruct", help="target name or directory (tokenizer)")
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
    from dspark.models.loading import target_dir
    from dspark.serving.launcher import ServerError, serving_session

    engines = Path(args.engines)
    if not (engines / "manifest.json").exists():
        print(f"error: no engines in {engines}: run `make engines` first", file=sys.stderr)
        return 2
    settings = dict(
        num_slots=args.slots,
        max_len=args.max_len,
        threads=args.threads,
        max_new_tokens=args.max_new_tokens,
        default_mode=args.default_mode,
        max_queue=args.max_queue,
        prefill_budget=args.prefill_budget,
        sps_path=str(Path(args.sps).resolve()) if Path(args.sps).exists() else "",
    )
    repo, tdir = Path(args.repository), target_dir(args.target)
    if args.render_only:
        try:
            models = render(args.profile, repo, engines, tdir, **settings)
            validate(repo, require_files=args.profile == "cpu")
        except RenderError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"[serve] rendered {args.profile} repository {repo}: {', '.join(models)}")
        return 0
    stop = threading.Event()
    ports = (args.http_port, args.grpc_port, args.metrics_port)
    try:
        with serving_session(
            engines, repo, tdir, args.profile, ports=ports, host=args.host, **settings
        ) as server:
            print(
                f"[serve] {args.profile} repository {repo}: {', '.join(server.models)}; ready: gRPC "
                f"{args.host}:{args.grpc_port}, HTTP {args.host}:{args.http_port}, metrics "
                f"{args.host}:{args.metrics_port}/metrics (log {server.log_path}); Ctrl-C stops it",
                flush=True,
            )
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())
            while not stop.is_set() and server.alive():
                stop.wait(0.5)
    except (RenderError, ServerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, RenderError) else 1
    if not stop.is_set():
        code = server.proc.returncode if server.proc else None
        print(f"error: tritonserver exited on its own (code {code}):\n{server.log_tail()}", file=sys.stderr)
        return 1
    print("[serve] stopped")
    return 0


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


@contextmanager
def demo_server(args: argparse.Namespace):
    """`make demo`'s server: tritonserver on free loopback ports serving the engines (the shipped
    SPS table when present); yields run(prompt, mode, on_text) → (token ids, seconds, stats)."""
    from dspark.serving.client import stream_generate
    from dspark.serving.launcher import serving_session

    sps = REPO / "results" / "sps.json"
    t0 = time.perf_counter()
    print("[demo] starting tritonserver on free loopback ports", flush=True)
    settings = dict(
        num_slots=4, max_len=2048, threads=args.threads, sps_path=str(sps) if sps.exists() else ""
    )
    with serving_session(
        Path(args.engines), REPO / "build" / "demo_repository", _target(args.target), **settings
    ) as server:
        url = f"127.0.0.1:{server.grpc_port}"
        print(
            f"[demo] ready in {time.perf_counter() - t0:.1f} s: gRPC {url}, "
            f"HTTP 127.0.0.1:{server.http_port}, "
            f"metrics 127.0.0.1:{server.metrics_port}/metrics (models: {', '.join(server.models)})"
        )
        # the first request pays the server's one-time startup work (SPS probe without a table)
        stream_generate(url, text="Hi", max_tokens=2, mode="dspark")

        def run(prompt: str, mode: str, on_text):
            g = stream_generate(url, text=prompt, max_tokens=args.max_tokens, mode=mode, on_text=on_text)
            return g.token_ids, g.seconds, g.stats or {}

        yield run


def _target(name: str):
    from dspark.models.loading import target_dir

    return target_dir(name)
