"""`make gpu-check` / `dspark gpu-check`: the whole GPU half on one NVIDIA GPU in about 8 minutes.

Phases, each writing results/gpu/phase-<name>.json as soon as it ends (a run cut short keeps what it
measured), each skipped with its reason when the time budget cannot hold it:

  env     the GPU, driver, torch/CUDA, TensorRT, ONNX Runtime providers; no GPU → exit 2
  build   `dspark engines --profile gpu` for the buckets the bench uses: ONNX export, TensorRT
          plans (timing cache), graph + greedy parity gates against PyTorch on the GPU
          (parity.json); a parity failure makes the whole check exit 1 at the end
  sps     SPS(B) of the target through the gpu-profile server: perf_analyzer when it runs here,
          else the same probe entry timed with the tritonclient (the JSON says which)
  bench   off, static:7, dspark, dspark-skip × concurrency 1, 8, 32 of streaming clients
  summary summary.json + summary.md (the table the README quotes)

`--device cpu --profile cpu --runtime ort` runs the same driver without a GPU (the unit test
does, on tiny engines, with --skip build).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

from dspark.paths import REPO

MODES = ["off", "static:7", "dspark", "dspark-skip"]
CONCURRENCY = [1, 8, 32]
PHASES = ["env", "build", "sps", "bench"]
# seconds a phase needs at least (skipped with its reason when less is left)
NEEDS = {"build": 120, "sps": 30, "bench": 60}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "gpu-check", help="build, parity, gpu-profile server, SPS and a short bench → results/gpu"
    )
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--profile", default="gpu", choices=["cpu", "gpu"])
    p.add_argument(
        "--runtime", default="tensorrt", choices=["torch", "ort", "tensorrt"], help="served runtime"
    )
    p.add_argument("--precision", default="fp32", help="plans built (comma list); the first is served")
    p.add_argument("--engines", default="build/engines-gpu")
    p.add_argument("--target", default="smollm2-135m-instruct", help="target name or checkpoint directory")
    p.add_argument("--drafter", default="dspark")
    p.add_argument("--buckets", default="1,8,16")
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)))
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--sizes", default="1,2,4,8,16,32,64", help="SPS batch tokens")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for the whole check")
    p.add_argument("--skip", default="", help="phases to skip (comma list of build, sps, bench)")
    p.add_argument("--out", default="results/gpu")
    p.add_argument("--tritonserver", default=None)
    p.add_argument("--backend-dir", dest="backend_directory", default=None)
    p.add_argument("--threads", type=int, default=4)
    p.set_defaults(fn=run)


class Check:
    def __init__(self, args) -> None:
        args.engines = str(Path(args.engines).resolve())  # the build runs in a process of its own
        self.args = args
        self.t0 = time.monotonic()
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.phases: dict[str, dict] = {}
        self.parity_ok: bool | None = None

    def left(self) -> float:
        return self.args.budget - (time.monotonic() - self.t0)

    def log(self, msg: str) -> None:
        print(f"[gpu-check {time.monotonic() - self.t0:5.0f} s] {msg}", flush=True)

    def phase(self, name: str, fn) -> dict:
        skip = {s for s in self.args.skip.split(",") if s}
        if name in skip:
            rec = {"status": "skipped", "why": "--skip"}
        elif self.left() < NEEDS.get(name, 0):
            rec = {
                "status": "skipped",
                "why": f"{self.left():.0f} s left of the {self.args.budget:.0f} s budget",
            }
        else:
            t = time.monotonic()
            self.log(f"{name} ...")
            try:
                rec = {"status": "ok", **(fn() or {})}
            except Exception as e:  # noqa: BLE001 - a failed phase is recorded, the next ones still run
                rec = {
                    "status": "failed",
                    "error": f"{type(e).__name__}: {e}",
                    "trace": traceback.format_exc()[-3000:],
                }
            rec["seconds"] = round(time.monotonic() - t, 1)
        self.phases[name] = rec
        (self.out / f"phase-{name}.json").write_text(json.dumps(rec, indent=2, default=str))
        self.log(
            f"{name}: {rec['status']}"
            + (f" ({rec.get('why') or rec.get('error')})" if rec["status"] != "ok" else "")
        )
        return rec

    def server(self) -> dict:
        a = self.args
        return {
            "profile": a.profile,
            "runtime": a.runtime,
            "device": a.device if a.profile == "gpu" else None,
            "precision": a.precision.split(",")[0],
            "tritonserver": a.tritonserver,
            "backend_dir": a.backend_directory,
        }


def env_info(device: str) -> dict:
    import onnxruntime
    import torch

    info = {
        "python": platform.python_version(),
        "machine": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "onnxruntime": onnxruntime.__version__,
        "ort_providers": onnxruntime.get_available_providers(),
    }
    from dspark.engines.tensorrt import tensorrt_version

    info["tensorrt"] = tensorrt_version()
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        info["nvidia_smi"] = r.stdout.strip()
    if device.startswith("cuda"):
        from dspark.engines.tensorrt import gpu_info

        info["gpu"] = gpu_info(device)  # RuntimeUnavailable (clear) without a GPU
    return info


def build(c: Check) -> dict:
    a = c.args
    argv = [
        "engines",
        "--target",
        a.target,
        "--drafter",
        a.drafter,
        "--out",
        a.engines,
        "--buckets",
        a.buckets,
        "--max-context",
        str(a.max_context),
        "--threads",
        str(a.threads),
        "--no-verify",
    ]
    if a.profile == "gpu":
        argv += [
            "--profile",
            "gpu",
            "--precision",
            a.precision,
            "--device",
            a.device,
            "--max-len",
            str(a.max_len),
            "--max-rows",
            str(max(int(x) for x in a.concurrency.split(","))),
        ]
    # a process of its own: the build's GPU memory is free again before the server starts
    code = subprocess.run([sys.executable, "-m", "dspark.cli", *argv], cwd=REPO).returncode
    rec: dict = {"exit_code": code, "argv": argv}
    eng = Path(a.engines)
    parity = eng / "parity.json"
    if parity.exists():
        shutil.copy2(parity, c.out / "parity.json")
        rec["parity"] = {k: v for k, v in json.loads(parity.read_text()).items() if k != "graphs"}
        c.parity_ok = bool(rec["parity"]["ok"])
    man = json.loads((eng / "manifest.json").read_text())
    rec["tensorrt"] = man.get("tensorrt")
    rec["plans"] = [
        {k: e.get(k) for k in ("file", "precision", "build_seconds", "verified")}
        for e in man["engines"]
        if e.get("backend") == "tensorrt"
    ]
    if code == 2:
        raise RuntimeError(f"dspark engines exited 2: {' '.join(argv)}")
    return rec


def sps(c: Check) -> dict:
    from dspark.perf.sps import PerfAnalyzerError, run_sweep

    a = c.args
    sizes = [int(x) for x in a.sizes.split(",")]
    out = c.out / "sps.json"
    try:
        run_sweep(Path(a.engines), sizes, [256], out, a.threads, 20, 1, log=c.log, server=c.server())
        return {"source": "perf_analyzer", "table": str(out)}
    except (PerfAnalyzerError, OSError, FileNotFoundError) as e:
        c.log(f"perf_analyzer unavailable ({e}): timing the probe entry with the tritonclient")
    return quick_sps(c, sizes, out)


def quick_sps(c: Check, sizes: list[int], out: Path) -> dict:
    """The target's probe entry timed from a tritonclient (no perf_analyzer): client-side."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    from dspark.core.sps import measure_sps
    from dspark.serving.launcher import serving_session

    a = c.args
    with serving_session(
        Path(a.engines),
        REPO / "build" / "gpu-check-sps",
        None,
        models=["target"],
        num_slots=1,
        max_len=256 + 128,
        threads=a.threads,
        log_path=c.out / "sps-server.log",
        **c.server(),
    ) as server:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")

        def step(b: int) -> None:
            t = grpcclient.InferInput("probe_tokens", [1, b], "INT64")
            t.set_data_from_numpy(np.ones((1, b), np.int64))
            ctx = grpcclient.InferInput("probe_context", [1], "INT64")
            ctx.set_data_from_numpy(np.array([256], np.int64))
            client.infer("target", [t, ctx], outputs=[grpcclient.InferRequestedOutput("probe_argmax")])

        table = measure_sps(
            step, sizes, 5, {"source": "tritonclient probe (client side, gRPC included)", "context": 256}
        )
        client.close()
    out.write_text(json.dumps(table.to_dict(), indent=2))
    return {"source": "tritonclient probe", "table": str(out), "sps": table.to_dict()}


def bench(c: Check) -> dict:
    from dspark.models.loading import target_dir
    from dspark.perf.bench import bench_prompts, run_bench
    from dspark.serving.launcher import serving_session

    a = c.args
    modes, conc = a.modes.split(","), [int(x) for x in a.concurrency.split(",")]
    table = c.out / "sps.json"
    settings = dict(
        num_slots=max(conc),
        max_len=a.max_len,
        threads=a.threads,
        max_queue=4 * max(conc),
        sps_path=str(table.resolve()) if table.exists() else "",
    )
    out = c.out / "bench.json"
    time_limit = max(10.0, (c.left() - 30) / (len(modes) * len(conc)))
    meta = {"server": {k: v for k, v in c.server().items() if v}, "command": "dspark gpu-check"}
    with serving_session(
        Path(a.engines),
        REPO / "build" / "gpu-check-bench",
        target_dir(a.target),
        log_path=c.out / "bench-server.log",
        **settings,
        **c.server(),
    ) as server:
        res = run_bench(
            f"127.0.0.1:{server.grpc_port}",
            modes,
            conc,
            bench_prompts(60),
            a.max_tokens,
            3,
            time_limit,
            out,
            f"http://127.0.0.1:{server.metrics_port}/metrics",
            server.proc.pid,
            meta,
            log=c.log,
        )
    return {"table": str(out), "cells": len(res["runs"]), "time_limit_per_cell_s": round(time_limit, 1)}


COLS = [
    ("per_user_tps", "per-user tok/s", 1),
    ("aggregate_tps", "aggregate tok/s", 1),
    ("tau", "τ", 2),
    ("step_ms", "step ms", 1),
    ("bls_mb_per_step", "BLS MB/step", 2),
    ("itl_ms_p50", "ITL p50 ms", 1),
]


def summary(c: Check) -> dict:
    s = {"phases": c.phases, "parity_ok": c.parity_ok, "seconds": round(time.monotonic() - c.t0, 1)}
    s["server"] = c.server()
    lines = ["# GPU check", ""]
    env = c.phases.get("env", {})
    gpu = env.get("gpu") or {}
    lines.append(
        f"GPU: {gpu.get('name', '—')} (driver {gpu.get('driver', '—')}, CUDA {env.get('torch_cuda')}); "
        f"torch {env.get('torch')}, TensorRT {env.get('tensorrt')}, onnxruntime {env.get('onnxruntime')}"
    )
    lines.append(
        f"Served: {json.dumps({k: v for k, v in c.server().items() if v})}; check took {s['seconds']} s."
    )
    lines.append("")
    lines.append("| phase | status | seconds | note |")
    lines.append("|---|---|---|---|")
    for name in PHASES:
        r = c.phases.get(name, {"status": "not run"})
        lines.append(
            f"| {name} | {r['status']} | {r.get('seconds', '')} | {r.get('why') or r.get('error') or ''} |"
        )
    par = c.phases.get("build", {}).get("parity")
    if par:
        lines += [
            "",
            f"Parity on the GPU: **{'ok' if par['ok'] else 'FAILED'}**; max |Δ| logits vs PyTorch "
            f"{par.get('max_abs_diff_logits', 0):.1e}; graphs failed: {par.get('graphs_failed') or 'none'}",
        ]
        for name, g in (par.get("greedy") or {}).items():
            divs = [p["first_divergence"] for p in g["prompts"] if not p["equal"]]
            note = "; ".join(f"pos {d['position']}: gap {d['reference_top2_gap']:.2e}" for d in divs[:3])
            lines.append(
                f"- greedy {name}: {g['equal']}/{g['total']} prompts equal to the torch runtime {note}"
            )
    bench_json = c.out / "bench.json"
    if bench_json.exists():
        runs = json.loads(bench_json.read_text())["runs"]
        lines += [
            "",
            "| mode | c | " + " | ".join(h for _, h, _ in COLS) + " |",
            "|---|---|" + "---|" * len(COLS),
        ]
        for r in sorted(
            runs, key=lambda r: (r["concurrency"], MODES.index(r["mode"]) if r["mode"] in MODES else 99)
        ):
            cells = [("—" if r.get(k) is None else f"{r[k]:.{d}f}") for k, _, d in COLS]
            lines.append(f"| {r['mode']} | {r['concurrency']} | " + " | ".join(cells) + " |")
        s["bench"] = runs
    sps_json = c.out / "sps.json"
    if sps_json.exists():
        t = json.loads(sps_json.read_text())
        pts = t.get("batch_tokens") or t.get("sizes") or []
        val = t.get("steps_per_second") or []
        if pts and val:
            lines += ["", "SPS(B): " + ", ".join(f"B={b}: {v:.0f}/s" for b, v in zip(pts, val))]
    (c.out / "summary.md").write_text("\n".join(lines) + "\n")
    (c.out / "summary.json").write_text(json.dumps(s, indent=2, default=str))
    return s


def run(args: argparse.Namespace) -> int:
    c = Check(args)
    env = c.phase("env", lambda: env_info(args.device))
    if env["status"] != "ok":
        print(f"error: {env.get('error')}", file=sys.stderr)
        summary(c)
        return 2
    for name, fn in (("build", build), ("sps", sps), ("bench", bench)):
        c.phase(name, lambda fn=fn: fn(c))
    s = summary(c)
    c.log(f"summary: {c.out / 'summary.md'}")
    if c.parity_ok is False:
        print("error: parity on the GPU FAILED (results/gpu/parity.json)", file=sys.stderr)
        return 1
    failed = [n for n, r in s["phases"].items() if r["status"] == "failed"]
    return 1 if failed else 0
