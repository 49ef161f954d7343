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

from dspark.cli.server_args import add_server_args, render_settings, server_settings
from dspark.core.scheduler import DEFAULT_MODE
from dspark.paths import REPO


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
    add_server_args(s)
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
    s.add_argument(
        "--default-mode", default=DEFAULT_MODE, help=f"mode of requests naming none (default {DEFAULT_MODE})"
    )
    s.add_argument("--max-queue", type=int, default=64, help="waiting requests before 'busy' errors")
    s.add_argument(
        "--prefill-budget", type=int, default=2048,
        help="prompt tokens admitted (prefilled) per engine step, at least one request; 0 = no limit",
    )  # fmt: skip
    s.add_argument("--render-only", action="store_true", help="render + validate the repository, then exit")
    s.add_argument(
        "--no-render", action="store_true",
        help="serve --repository as it is (rendered before by --render-only, e.g. in an initContainer)",
    )  # fmt: skip
    s.add_argument(
        "--allow-remote", action="store_true",
        help="required for a --host other than loopback: the server has no authentication",
    )  # fmt: skip
    s.add_argument(
        "--exit-timeout", type=int, default=5,
        help="on SIGTERM, seconds tritonserver waits for running requests (streams) before exiting",
    )  # fmt: skip
    s.add_argument(
        "--no-supervise", action="store_true",
        help="do not watch the python-backend stubs (by default a dead stub is reloaded or the server "
        "restarted: Triton 2.51 neither restarts it nor reports it in its health endpoints)",
    )  # fmt: skip
    s.add_argument("--max-prompt-tokens", type=int, default=0, help="per-request prompt cap (0 = context)")
    s.add_argument("--max-stop-strings", type=int, default=8, help="per-request number of stop strings")
    s.add_argument("--max-stop-chars", type=int, default=128, help="characters per stop string")
    s.add_argument("--max-request-bytes", type=int, default=1 << 20, help="bytes of inputs per request")
    s.set_defaults(fn=serve)


def serve(args: argparse.Namespace) -> int:
    from dspark.model_repository.render import RenderError, render, validate
    from dspark.serving.exposure import ExposureError, check_host

    try:
        warning = check_host(args.host, args.allow_remote)
    except ExposureError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    if args.no_render:
        return _run(args, None)
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
            max_prompt_tokens=args.max_prompt_tokens,
            max_stop_strings=args.max_stop_strings,
            max_stop_chars=args.max_stop_chars,
            max_request_bytes=args.max_request_bytes,
            **render_settings(args),
        )
        validate(Path(args.repository))
    except RenderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[serve] rendered {args.profile} repository {args.repository}: {', '.join(models)}")
    if args.render_only:
        return 0
    return _run(args, models)


def _run(args: argparse.Namespace, models: list[str] | None) -> int:
    from dspark.model_repository.render import RenderError, validate
    from dspark.serving.launcher import Server, ServerError

    if models is None:  # --no-render: the repository as it is
        try:
            models = sorted(validate(Path(args.repository)))
        except (RenderError, OSError) as e:
            print(f"error: {args.repository}: {e}", file=sys.stderr)
            return 2
    server = Server(
        Path(args.repository).resolve(),
        models,
        args.http_port,
        args.grpc_port,
        args.metrics_port,
        host=args.host,
        exit_timeout=args.exit_timeout,
        binary=Path(args.tritonserver) if args.tritonserver else None,
        backend_directory=Path(args.backend_directory) if args.backend_directory else None,
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
    from dspark.serving.supervisor import Supervisor

    supervisor = None if args.no_supervise else Supervisor(server, log=lambda m: print(m, flush=True))
    while not stop.is_set():
        try:
            if not server.alive():  # on its own: a python-backend abort is restarted, else we exit
                if supervisor is not None and supervisor.after_exit(server.proc.returncode):
                    continue
                break
            stop.wait(1.0)
            if supervisor is not None and not stop.is_set():
                supervisor.check()
        except (OSError, ServerError) as e:
            print(f"error: could not repair the server: {e}", file=sys.stderr)
            server.stop()
            return 1
    if stop.is_set() and server.alive():
        from dspark.serving.supervisor import drain

        drain(server, args.exit_timeout, log=lambda m: print(m, flush=True))
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
        Path(args.engines),
        REPO / "build" / "demo_repository",
        _target(args.target),
        **settings,
        **server_settings(args),
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
