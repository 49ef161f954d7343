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
    s.add_argument("--sps", default="perf/results/sps.json", help="SPS(B) table (else a quick startup probe)")
    s.add_argument("--default-mode", default="dspark")
    s.add_argument("--max-queue", type=int, default=64, help="waiting requests before 'busy' errors")
    s.add_argument("--render-only", action="store_true", help="render + validate the repository, then exit")
    s.set_defaults(fn=serve)


def serve(args: argparse.Namespace) -> int:
    from orchestrator.repository import RenderError, render, validate
    from orchestrator.server import Server, ServerError

    engines = Path(args.engines)
    if not (engines / "manifest.json").exists():
        print(f"error: no engines in {engines}: run `make engines` first", file=sys.stderr)
        return 2
    target_dir = _target_dir(args.target)
    try:
        models = render(
            args.profile,
            Path(args.repository),
            engines,
            target_dir,
            num_slots=args.slots,
            max_len=args.max_len,
            threads=args.threads,
            max_new_tokens=args.max_new_tokens,
            default_mode=args.default_mode,
            max_queue=args.max_queue,
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


def _target_dir(name: str) -> Path:
    from dspark.models import DEFAULT_TARGET, cache_dir, load_target

    if name == DEFAULT_TARGET:
        path = cache_dir() / DEFAULT_TARGET
        if not (path / "tokenizer.json").exists():
            load_target(name)  # converts and caches it once
        return path
    return Path(name)


def generate_remote(args: argparse.Namespace) -> int:
    """Stream one answer from a running server over gRPC."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    done = threading.Event()
    state = {"text": [], "ids": [], "stats": None, "error": None}

    def callback(result=None, error=None):
        if error is not None:
            state["error"] = str(error)
            done.set()
            return
        text = result.as_numpy("text_output")
        ids = result.as_numpy("token_ids")
        stats = result.as_numpy("stats")
        if text is not None and len(text):
            piece = text[0].decode("utf-8", "replace")
            state["text"].append(piece)
            if not args.json:
                print(piece, end="", flush=True)
        if ids is not None:
            state["ids"] += ids.tolist()
        if stats is not None and len(stats):
            state["stats"] = json.loads(stats[0])
        if result.get_response().parameters["triton_final_response"].bool_param:
            done.set()

    def tensor(name, arr, dtype):
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        return t

    inputs = [
        tensor("text_input", np.array([args.prompt.encode()], dtype=np.object_), "BYTES"),
        tensor("max_tokens", np.array([args.max_tokens], np.int32), "INT32"),
        tensor("temperature", np.array([args.temperature], np.float32), "FP32"),
        tensor("top_p", np.array([args.top_p], np.float32), "FP32"),
        tensor("top_k", np.array([args.top_k], np.int32), "INT32"),
        tensor("mode", np.array([args.mode.encode()], dtype=np.object_), "BYTES"),
    ]
    if args.seed is not None:
        inputs.append(tensor("seed", np.array([args.seed], np.int64), "INT64"))
    t0 = time.perf_counter()
    client = grpcclient.InferenceServerClient(args.url)
    try:
        client.start_stream(callback=callback)
        client.async_stream_infer("dspark", inputs, request_id="cli", enable_empty_final_response=True)
        if not done.wait(args.timeout):
            print(f"error: no final response within {args.timeout} s", file=sys.stderr)
            return 1
    except Exception as e:  # connection refused etc.
        print(f"error: cannot reach the server at {args.url}: {e}", file=sys.stderr)
        return 1
    finally:
        try:
            client.stop_stream()
        except Exception:
            pass
        client.close()
    if state["error"]:
        print(f"error: {state['error']}", file=sys.stderr)
        return 2
    dt = time.perf_counter() - t0
    if args.json:
        print(
            json.dumps({"text": "".join(state["text"]), "token_ids": state["ids"], "stats": state["stats"]})
        )
    else:
        s = state["stats"] or {}
        print(
            f"\n[{len(state['ids'])} tokens in {dt:.2f} s, mode={s.get('mode')}, τ {s.get('tau', 0):.2f}]",
            file=sys.stderr,
        )
    return 0
