"""`dspark sps` / `make sps`: the target's steps-per-second curve SPS(B), measured with perf_analyzer.

A tritonserver on loopback serves only the `target` model; perf_analyzer (the binary from the
tritonclient 2.51.0 wheel, installed by `make setup`) drives its probe entry — one sequence
verifying B new tokens on a cached synthetic context of L tokens, exactly the work of a
verification step of B batch tokens — at concurrency 1 for every B and L:

    perf_analyzer -m target -i grpc --concurrency-range 1 --input-data pB_L.json \
        --measurement-mode count_windows --percentile 50 -f pB_L.csv

The CSV is parsed by header name. Steps/s at B = 1e6 / `Server Compute Infer` (µs): the model's
own execution time, which is what a BLS call from the orchestrator pays (the client-side rate,
`Inferences/Second`, also carries gRPC and Python client overhead; both are stored). The table
the orchestrator loads is the curve at the first context length; the others are kept under
`curves` with their own context. Output: results/sps.json + results/sps.png.
"""

from __future__ import annotations

import csv
import json
import os
import platform
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from dspark.paths import REPO

DEFAULT_SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64]
DEFAULT_CONTEXTS = [256, 1024]


class PerfAnalyzerError(RuntimeError):
    pass


def perf_analyzer() -> tuple[Path, dict]:
    """The perf_analyzer binary and the environment it needs (libcudart from the venv)."""
    venv = Path(sys.executable).parent.parent
    exe = venv / "tools" / "bin" / "perf_analyzer"
    if not exe.exists():
        raise PerfAnalyzerError(
            f"no perf_analyzer at {exe}: run `make setup` (it extracts it from tritonclient 2.51.0)"
        )
    env = dict(os.environ)
    libs = [str(p) for p in (venv / "lib").glob("python3*/site-packages/nvidia/cuda_runtime/lib")]
    if not libs:
        raise PerfAnalyzerError("libcudart.so.12 is missing (nvidia-cuda-runtime-cu12): run `make setup`")
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [env.get("LD_LIBRARY_PATH", "")])
    return exe, env


def parse_csv(path: Path) -> list[dict[str, float]]:
    """perf_analyzer's CSV as dicts keyed by header name, sorted by concurrency (the file is
    sorted by throughput)."""
    with Path(path).open(newline="") as f:
        rows = [
            {k.strip(): float(v) for k, v in row.items() if k and v not in (None, "")}
            for row in csv.DictReader(f)
        ]
    if not rows:
        raise PerfAnalyzerError(f"{path} has no measurement rows")
    for col in ("Concurrency", "Inferences/Second", "Server Compute Infer", "p50 latency", "p99 latency"):
        if col not in rows[0]:
            raise PerfAnalyzerError(f"{path}: no column {col!r} (header: {sorted(rows[0])})")
    return sorted(rows, key=lambda r: r["Concurrency"])


def measure_point(
    url: str, b: int, context: int, workdir: Path, request_count: int = 40, vocab: int = 49152
) -> dict:
    """One perf_analyzer run: the probe entry at B tokens on a context of `context` tokens."""
    exe, env = perf_analyzer()
    workdir.mkdir(parents=True, exist_ok=True)
    data = workdir / f"probe_b{b}_l{context}.json"
    tokens = [(13 * i + 500) % vocab for i in range(b)]
    data.write_text(
        json.dumps(
            {"data": [{"probe_tokens": {"content": tokens, "shape": [1, b]}, "probe_context": [context]}]}
        )
    )
    out = workdir / f"probe_b{b}_l{context}.csv"
    # a shared machine can be too noisy for a 25% band: one retry with twice the requests and a
    # 50% band (recorded in the point) before giving up with perf_analyzer's own message
    for count, band in ((request_count, 25), (2 * request_count, 50)):
        out.unlink(missing_ok=True)
        cmd = [
            str(exe), "-m", "target", "-u", url, "-i", "grpc", "--concurrency-range", "1",
            "--input-data", str(data), "--measurement-mode", "count_windows",
            "--measurement-request-count", str(count), "--stability-percentage", str(band),
            "--max-trials", "6", "--percentile", "50", "-f", str(out),
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if proc.returncode == 0 and out.exists():
            break
        if "stable measurement" not in proc.stdout + proc.stderr:
            break
    if proc.returncode != 0 or not out.exists():
        raise PerfAnalyzerError(
            f"perf_analyzer failed at B={b}, L={context} (exit {proc.returncode}):\n"
            + proc.stdout[-1500:]
            + proc.stderr[-1500:]
        )
    row = parse_csv(out)[0]
    return {
        "batch_tokens": b,
        "context": context,
        "steps_per_second": 1e6 / row["Server Compute Infer"],
        "client_steps_per_second": row["Inferences/Second"],
        "compute_infer_us": row["Server Compute Infer"],
        "p50_us": row["p50 latency"],
        "p99_us": row["p99 latency"],
        "stability_percentage": band,
    }


def summarise(points: list[dict], context: int, sizes: list[int]) -> dict:
    """One context's curve: per B the median over passes (of step time, of the client-side rate,
    of the latencies), plus the monotone fit the scheduler reads (`SPSTable.monotone`)."""
    import statistics

    from dspark.core.sps import SPSTable

    pts = [p for p in points if p["context"] == context]

    def med(b: int, key: str) -> float:
        return statistics.median(p[key] for p in pts if p["batch_tokens"] == b)

    step_us = [med(b, "compute_infer_us") for b in sizes]
    fitted = SPSTable.from_step_times(sizes, [t / 1e6 for t in step_us]).monotone()
    return {
        "context": context,
        "batch_tokens": list(sizes),
        "steps_per_second": list(fitted.steps_per_second),
        "measured_steps_per_second": [1e6 / t for t in step_us],
        "client_steps_per_second": [med(b, "client_steps_per_second") for b in sizes],
        "p50_us": [med(b, "p50_us") for b in sizes],
        "p99_us": [med(b, "p99_us") for b in sizes],
    }


def versions() -> dict:
    import onnxruntime

    return {
        "perf_analyzer": "tritonclient 2.51.0 wheel",
        "tritonserver": "2.51.0 (nvidia-pytriton 0.7.0)",
        "onnxruntime": onnxruntime.__version__,
        "python": platform.python_version(),
    }


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.platform()}"


def run_sweep(
    engines: Path,
    sizes: list[int],
    contexts: list[int],
    out: Path,
    threads: int = 2,
    request_count: int = 40,
    passes: int = 3,
    log=print,
    server: dict | None = None,
) -> dict:
    """Start a target-only server on free loopback ports, sweep, write `out` (+ .png). `server`:
    serving_session's profile / runtime / device / tritonserver settings (default: cpu)."""
    from tqdm import tqdm

    from dspark.core.sps import SPSTable
    from dspark.serving.launcher import serving_session

    if max(sizes) + 1 > 64 + 1:
        raise ValueError("the probe entry takes at most 64 tokens per step (B <= 64)")
    work = REPO / "build" / "sps"
    vocab = json.loads((engines / "target_meta.json").read_text())["config"]["vocab_size"]
    t0 = time.perf_counter()
    points = []
    settings = dict(num_slots=1, max_len=max(contexts) + 64, threads=threads)
    with serving_session(
        engines, work / "repository", models=["target"], log_path=work / "server.log", **settings,
        **(server or {}),
    ) as srv:  # fmt: skip
        url = f"127.0.0.1:{srv.grpc_port}"
        log(f"[sps] target on {url}; {len(sizes)} sizes × {len(contexts)} contexts through perf_analyzer")
        with tqdm(total=len(sizes) * len(contexts) * passes, unit="point", desc="sps") as bar:
            for k in range(passes):
                for L in contexts:
                    # odd passes run B downwards: a drift of the machine's speed during a pass
                    # then biases the two directions oppositely and the median cancels most of it
                    for b in sizes if k % 2 == 0 else sizes[::-1]:
                        p = measure_point(url, b, L, work / "csv", request_count, vocab)
                        points.append({**p, "pass": k})
                        bar.set_postfix(B=b, L=L, sps=f"{p['steps_per_second']:.0f}")
                        bar.update()
    curves = [summarise(points, L, sizes) for L in contexts]
    meta = {
        "source": "perf_analyzer on the target's probe entry (1e6 / Server Compute Infer µs)",
        "context": contexts[0],
        "machine": machine(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "threads": threads,
        "engines": str(engines),
        "versions": versions(),
        "command": "dspark sps " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["sps"] else "dspark sps",
        "wall_seconds": round(time.perf_counter() - t0, 1),
        "passes": passes,
        "server": {k: v for k, v in (server or {}).items() if v is not None},
    }
    first = curves[0]
    # the first curve is already the monotone fit (summarise): the table is it, labelled so
    table = SPSTable(first["batch_tokens"], first["steps_per_second"], {**meta, "fit": SPSTable.MONOTONE_FIT})
    result = {**table.to_dict(), "curves": curves, "points": points}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    log(f"[sps] wrote {out} and {out.with_suffix('.png')} in {meta['wall_seconds']:.0f} s")
    return result


def plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for c in result["curves"]:
        b = c["batch_tokens"]
        line = a1.plot(b, c["steps_per_second"], label=f"server compute, monotone fit, L={c['context']}")[0]
        if "measured_steps_per_second" in c:
            meas = c["measured_steps_per_second"]
            a1.plot(b, meas, "o", ms=3, color=line.get_color(), label="median of passes")
        a1.plot(b, c["client_steps_per_second"], ls="--", lw=1, label=f"client side, L={c['context']}")
        tok = [x * y for x, y in zip(b, c["steps_per_second"])]
        a2.plot(b, tok, marker="o", ms=3, label=f"L={c['context']}")
    a1.set_xlabel("batch tokens B per step")
    a1.set_ylabel("steps / s")
    a1.set_title("SPS(B): target verify step (perf_analyzer)")
    a1.legend(fontsize=8)
    a2.set_xlabel("batch tokens B per step")
    a2.set_ylabel("tokens / s (B × SPS)")
    a2.set_title("token throughput of one step")
    a2.legend(fontsize=8)
    m = result["meta"]
    fig.suptitle(f"{m['machine']} · {m['date']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
