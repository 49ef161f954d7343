"""`dspark bench` / `make bench`: streaming clients against the real server, every mode side by side.

For each mode (off, static:1, static:3, static:7, threshold:0.5, dspark, dspark-async,
dspark-skip) and each concurrency c ∈ {1, 2, 4, 8, 16, 32}, c client threads stream greedy
answers to prompts from ../shared/data/eval (gsm8k-test, humaneval, mt-bench in turn) through
gRPC, each until its share of the cell's requests is done or the cell's time limit passes.
All cells run against one server started here (or `--url`), so the ratios are side by side.

Reported per cell (results/bench.json + .csv):
  per_user_tps     mean over requests of new tokens / (request sent → last token)
  aggregate_tps    all new tokens / wall time of the cell
  ttft_ms_p50, itl_ms_p50, itl_ms_p99   (ITL: gaps between streamed responses, spread over
                   the tokens each carried)
  tau              committed tokens per round (server stats), mean_verify_len: drafts verified
                   per round (ℓ, 0 for off)
  peak_rss_mb      peak resident memory of the whole server process group during the cell
  overhead         1 − model execution time / engine step wall time, from the server's own
                   counters: Triton's compute (input + infer + output) of target,
                   drafter_backbone and drafter_head over dspark_round_seconds_total —
                   i.e. the share of a round spent in BLS transport, Python, scheduling, sampling;
                   split per step into model_ms, bls_transport_ms (time inside BLS calls minus
                   the models' compute) and python_ms (everything outside BLS calls)
Plots: <out stem>_pareto.png (per-user vs aggregate tok/s, a line per mode) and <out stem>_verify_len.png
(mean ℓ vs concurrency). `goals` in the JSON evaluates the issue's ratios on this run.
"""

from __future__ import annotations

import csv
import json
import threading
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

MODES = ["off", "static:1", "static:3", "static:7", "threshold:0.5", "dspark", "dspark-async", "dspark-skip"]
CONCURRENCY = [1, 2, 4, 8, 16, 32]
SETS = ["gsm8k-test", "humaneval", "mt-bench"]
MODELS = ["target", "drafter_backbone", "drafter_head"]


def request_lengths(max_tokens: int, spread: float, n: int, seed: int = 0) -> list[int]:
    """Each request's max_tokens in a cell: all `max_tokens` (spread 0), or drawn uniformly from
    max_tokens × [1 − spread, 1 + spread], the same draw in every cell and mode. With equal lengths
    and clients that start together, streams that draft nothing finish in the same step and the
    next wave's prompts prefill together (one long step: 3.8–4.1 s to the first token at 16 clients
    against 0.7 s with a spread, docs/decisions.md); a spread staggers every mode's arrivals, as
    real traffic is."""
    if not 0.0 <= spread < 1.0:
        raise ValueError(f"length spread must be in [0, 1), got {spread}")
    if spread == 0.0:
        return [max_tokens] * n
    lo, hi = max(1, round(max_tokens * (1 - spread))), round(max_tokens * (1 + spread))
    return [int(x) for x in np.random.default_rng(seed).integers(lo, hi + 1, size=n)]


def bench_prompts(n: int, per_set: int = 20) -> list[dict]:
    """n prompts, round-robin over the three eval sets (first turns; the first `per_set` of each
    set, repeated when n is larger; the in-repository sample's 8 when ../shared is absent)."""
    from dspark.prompts import PromptsError, eval_prompts

    per = {}
    for s in SETS:
        try:
            per[s] = eval_prompts(s, per_set)
        except PromptsError:
            per[s] = eval_prompts(s, 8, source="repo")
    return [{"text": per[SETS[i % 3]][(i // 3) % len(per[SETS[i % 3]])]} for i in range(n)]


class RssMonitor:
    """Peak summed RSS of a process group (the server and its python-backend stubs)."""

    def __init__(self, pgid: int | None, period: float = 0.25) -> None:
        self.pgid, self.period, self.peak = pgid, period, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> float:
        total = 0
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                stat = (d / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[2]) != self.pgid:
                    continue
                for line in (d / "status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
            except (OSError, ValueError, IndexError):
                continue
        return total / 1024.0

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.sample())
            self._stop.wait(self.period)

    def __enter__(self) -> RssMonitor:
        if self.pgid is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2)


def server_counters(url: str, metrics_url: str | None) -> dict:
    """Model compute seconds (Triton statistics) and engine step seconds (our metrics)."""
    import tritonclient.grpc as grpcclient

    from dspark.orchestrator.metrics import parse_prometheus

    out: dict = {"model_seconds": 0.0, "model_seconds_by": {}}
    c = grpcclient.InferenceServerClient(url)
    try:
        for m in MODELS:
            try:
                st = c.get_inference_statistics(model_name=m, as_json=True)
            except Exception:  # noqa: BLE001 - a model not loaded (target-only server)
                continue
            for ms in st.get("model_stats", []):
                inf = ms.get("inference_stats", {})
                for part in ("compute_input", "compute_infer", "compute_output"):
                    sec = int(inf.get(part, {}).get("ns", 0)) / 1e9
                    out["model_seconds"] += sec
                    out["model_seconds_by"][m] = out["model_seconds_by"].get(m, 0.0) + sec
    finally:
        c.close()
    if metrics_url:
        with urllib.request.urlopen(metrics_url, timeout=5) as r:
            m = parse_prometheus(r.read().decode())
        out["step_seconds"] = m.get('dspark_round_seconds_total{model="dspark"}', 0.0)
        out["steps"] = m.get('dspark_rounds_total{model="dspark"}', 0.0)
        out["bls_seconds"] = sum(v for k, v in m.items() if k.startswith("dspark_bls_seconds_total"))
        out["bls_calls"] = sum(v for k, v in m.items() if k.startswith("dspark_bls_calls_total"))
        out["bls_bytes"] = sum(v for k, v in m.items() if k.startswith("dspark_bls_bytes_total"))
        out["skip_prices"] = {
            k.split('what="')[1].split('"')[0]: v
            for k, v in m.items()
            if k.startswith("dspark_skip_price_seconds")
        }
        for reason in ("merit", "refresh", "new"):
            label = f'reason="{reason}"'
            out[f"draft_rounds_{reason}"] = sum(
                v for k, v in m.items() if k.startswith("dspark_draft_rounds_total") and label in k
            )
    return out


# A request started just before a cell's deadline may queue behind every other client and then
# stream at 1/c of the server's rate: at c = 64 on a slow 2-core VM that is ~2 minutes. Its
# timeout is the cell's time limit plus this grace, so a slow machine measures slowly instead of
# cancelling its own requests (every wait stays bounded).
REQUEST_GRACE_S = 300.0


def run_cell(
    url: str,
    mode: str,
    concurrency: int,
    prompts: list[dict],
    max_tokens: int,
    requests: int,
    time_limit: float,
    metrics_url: str | None = None,
    pgid: int | None = None,
    length_spread: float = 0.0,
) -> dict:
    """One (mode, concurrency) cell: `requests` requests over `concurrency` clients, bounded
    by `time_limit` seconds (no new request starts after it); request i asks for
    `request_lengths(...)[i]` tokens."""
    from dspark.serving.client import ClientError, stream_generate

    gens, errors, lock = [], [], threading.Lock()
    deadline = time.monotonic() + time_limit
    counter = iter(range(requests))
    lengths = request_lengths(max_tokens, length_spread, requests)

    def client():
        while time.monotonic() < deadline:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            p = prompts[i % len(prompts)]
            try:
                g = stream_generate(
                    url, text=p.get("text"), input_ids=p.get("input_ids"), max_tokens=lengths[i],
                    mode=mode, timeout=time_limit + REQUEST_GRACE_S,
                )  # fmt: skip
                with lock:
                    gens.append(g)
            except ClientError as e:
                with lock:
                    errors.append(str(e))

    before = server_counters(url, metrics_url)
    t0 = time.perf_counter()
    with RssMonitor(pgid) as rss:
        threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(time_limit + REQUEST_GRACE_S + 60)
    wall = time.perf_counter() - t0
    after = server_counters(url, metrics_url)
    return summarize(mode, concurrency, gens, errors, wall, before, after, rss.peak if pgid else None)


def summarize(mode, concurrency, gens, errors, wall, before, after, peak_rss) -> dict:
    tokens = sum(len(g.token_ids) for g in gens)
    itl = [x for g in gens for x in g.itl()]
    ttft = [g.ttft for g in gens if g.ttft is not None]
    st = [g.stats or {} for g in gens]
    rounds = sum(s.get("rounds", 0) for s in st)
    step_s = after.get("step_seconds", 0.0) - before.get("step_seconds", 0.0)
    steps = after.get("steps", 0.0) - before.get("steps", 0.0)
    model_s = after["model_seconds"] - before["model_seconds"]
    bls_s = after.get("bls_seconds", 0.0) - before.get("bls_seconds", 0.0)
    bls_n = after.get("bls_calls", 0.0) - before.get("bls_calls", 0.0)
    bls_b = after.get("bls_bytes", 0.0) - before.get("bls_bytes", 0.0)

    def pct(xs, q):
        return float(np.percentile(xs, q) * 1e3) if xs else None

    return {
        "mode": mode,
        "concurrency": concurrency,
        "requests": len(gens),
        "errors": len(errors),
        "error_sample": errors[:2],
        "tokens": tokens,
        "wall_s": round(wall, 2),
        "per_user_tps": float(np.mean([len(g.token_ids) / g.seconds for g in gens if g.seconds > 0]))
        if gens
        else 0.0,
        "aggregate_tps": tokens / wall if wall > 0 else 0.0,
        "ttft_ms_p50": pct(ttft, 50),
        "itl_ms_p50": pct(itl, 50),
        "itl_ms_p99": pct(itl, 99),
        "tau": sum(s.get("committed_tokens", 0) for s in st) / rounds if rounds else None,
        "mean_verify_len": sum(s.get("verified_tokens", 0) for s in st) / rounds if rounds else None,
        "peak_rss_mb": round(peak_rss, 1) if peak_rss else None,
        "step_ms": 1e3 * step_s / steps if steps else None,
        "model_ms_per_step": 1e3 * model_s / steps if steps else None,
        # the same split by model (target, drafter_backbone, drafter_head)
        "model_ms_per_step_by_model": {
            m: round(1e3 * (s - before.get("model_seconds_by", {}).get(m, 0.0)) / steps, 3)
            for m, s in after.get("model_seconds_by", {}).items()
        }
        if steps
        else None,
        "overhead": 1.0 - model_s / step_s if step_s > 0 else None,
        "bls_calls_per_step": bls_n / steps if steps else None,
        "bls_mb_per_step": bls_b / steps / 1e6 if steps else None,
        "bls_transport_ms_per_step": 1e3 * (bls_s - model_s) / steps if steps else None,
        "python_ms_per_step": 1e3 * (step_s - bls_s) / steps if steps else None,
        # dspark-skip: the prices it planned with at the end of the cell (seconds)
        "skip_prices": after.get("skip_prices") or None,
        # dspark-skip: share of the rounds that made a draft call, by why (merit | refresh | new)
        "draft_rounds_per_step": {
            r: (after.get(f"draft_rounds_{r}", 0.0) - before.get(f"draft_rounds_{r}", 0.0)) / steps
            for r in ("merit", "refresh", "new")
        }
        if steps
        else None,
    }


def goals(runs: list[dict]) -> dict:
    """The issue's goals, evaluated on this run (ratios of cells measured side by side), for
    `dspark` (Algorithm 1, the issue's subject) and for each other scheduler mode in the run
    (keys name the mode: c1_dspark-skip_per_user_vs_off, ...)."""
    by = {(r["mode"], r["concurrency"]): r for r in runs}
    conc = sorted({r["concurrency"] for r in runs})
    fixed = [m for m in {r["mode"] for r in runs} if m == "off" or m.startswith("static:")]
    out = {}
    for mode in ("dspark", "dspark-async", "dspark-skip"):
        if ("off", 1) in by and (mode, 1) in by and by[("off", 1)]["per_user_tps"]:
            out[f"c1_{mode}_per_user_vs_off"] = by[(mode, 1)]["per_user_tps"] / by[("off", 1)]["per_user_tps"]
        worst = None
        for c in conc:
            if (mode, c) not in by:
                continue
            best = max((by[(m, c)]["aggregate_tps"] for m in fixed if (m, c) in by), default=None)
            if best:
                ratio = by[(mode, c)]["aggregate_tps"] / best
                out[f"c{c}_{mode}_aggregate_vs_best_fixed"] = ratio
                worst = ratio if worst is None else min(worst, ratio)
            if c >= 16 and ("static:7", c) in by and by[("static:7", c)]["aggregate_tps"]:
                out[f"c{c}_{mode}_aggregate_vs_static7"] = (
                    by[(mode, c)]["aggregate_tps"] / by[("static:7", c)]["aggregate_tps"]
                )
        if worst is not None:
            out[f"min_{mode}_aggregate_vs_best_fixed"] = worst
        if (mode, 1) in by and by[(mode, 1)]["overhead"] is not None:
            out[f"c1_{mode}_orchestrator_overhead"] = by[(mode, 1)]["overhead"]
    return out


def plot(result: dict, folder: Path, stem: str = "bench") -> list[Path]:
    """<stem>_pareto.png and <stem>_verify_len.png beside the JSON (named after it, so a partial
    sweep written elsewhere never replaces another sweep's plots)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    modes = [m for m in MODES if any(r["mode"] == m for r in runs)]
    fig, ax = plt.subplots(figsize=(7, 5))
    for m in modes:
        rs = sorted((r for r in runs if r["mode"] == m), key=lambda r: r["concurrency"])
        ax.plot([r["aggregate_tps"] for r in rs], [r["per_user_tps"] for r in rs], marker="o", ms=3, label=m)
        for r in rs:
            ax.annotate(str(r["concurrency"]), (r["aggregate_tps"], r["per_user_tps"]), fontsize=6)
    ax.set_xlabel("aggregate tokens/s")
    ax.set_ylabel("per-user tokens/s")
    ax.set_title(
        f"Pareto: concurrency sweep (labels = clients)\n{result['machine']} · {result['date']}", fontsize=8
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    p1 = folder / f"{stem}_pareto.png"
    fig.savefig(p1, dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in modes:
        rs = sorted(
            (r for r in runs if r["mode"] == m and r["mean_verify_len"] is not None),
            key=lambda r: r["concurrency"],
        )
        ax.plot([r["concurrency"] for r in rs], [r["mean_verify_len"] for r in rs], marker="o", ms=3, label=m)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("mean verification length ℓ per round")
    ax.legend(fontsize=7)
    fig.tight_layout()
    p2 = folder / f"{stem}_verify_len.png"
    fig.savefig(p2, dpi=110)
    plt.close(fig)
    return [p1, p2]


COLUMNS = [
    "mode", "concurrency", "per_user_tps", "aggregate_tps", "ttft_ms_p50", "itl_ms_p50", "itl_ms_p99",
    "tau", "mean_verify_len", "peak_rss_mb", "overhead", "step_ms", "model_ms_per_step",
    "bls_transport_ms_per_step", "python_ms_per_step", "bls_calls_per_step", "bls_mb_per_step", "requests",
    "errors", "tokens", "wall_s",
]  # fmt: skip


SUMMED = ("requests", "errors", "tokens", "wall_s")


def combine(single: list[dict]) -> list[dict]:
    """One row per (mode, concurrency) in first-seen order: the median over repeats of every
    rate, latency, ratio and per-step figure, the sum of the counts, the largest peak RSS."""
    cells: dict[tuple, list[dict]] = {}
    for r in single:
        cells.setdefault((r["mode"], r["concurrency"]), []).append(r)
    rows = []
    for rs in cells.values():
        row = {k: v for k, v in rs[0].items() if k != "repeat"}
        for k in row:
            dicts = [r[k] for r in rs if isinstance(r.get(k), dict)]
            if k == "model_ms_per_step_by_model" and len(dicts) == len(rs):  # per-model medians
                row[k] = {m: float(np.median([d.get(m, 0.0) for d in dicts])) for m in dicts[0]}
                continue
            vals = [r[k] for r in rs if isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)]
            if k in ("mode", "concurrency") or len(vals) != len(rs):
                continue
            if k in SUMMED:
                row[k] = sum(vals)
            elif k == "peak_rss_mb":
                row[k] = max(vals)
            else:
                row[k] = float(np.median(vals))
        row["error_sample"] = [e for r in rs for e in r.get("error_sample", [])][:2]
        row["repeats"] = len(rs)
        rows.append(row)
    return rows


def write(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    with out.with_suffix(".csv").open("w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(result["runs"])


def run_bench(
    url: str,
    modes: list[str],
    concurrencies: list[int],
    prompts: list[dict],
    max_tokens: int,
    min_requests: int,
    time_limit: float,
    out: Path | None,
    metrics_url: str | None = None,
    pgid: int | None = None,
    meta: dict | None = None,
    log=print,
    repeats: int = 1,
    length_spread: float = 0.0,
) -> dict:
    """Every (concurrency, mode) cell, `repeats` times: at each concurrency the modes run one
    after another, in reverse order on odd repeats, so that a drift of the machine's speed
    (±10–30% within minutes on a shared VM) does not always favour the same modes; `runs`
    holds per cell the median over repeats (`combine`), `repeat_runs` every single run."""
    from tqdm import tqdm

    from dspark.perf.sps import machine
    from dspark.serving.client import stream_generate

    for m in modes:  # warm every path once (first-call costs are not what users see)
        first = prompts[0]
        stream_generate(url, text=first.get("text"), input_ids=first.get("input_ids"), max_tokens=4, mode=m)
    result = {
        "runs": [],
        "machine": machine(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "settings": {
            "max_tokens": max_tokens,
            "length_spread": length_spread,
            "requests_per_cell": f"max({min_requests}, 2 × concurrency)",
            "time_limit_s": time_limit,
            "greedy": True,
            "repeats": repeats,
            **(meta or {}),
        },
    }
    # modes side by side at each concurrency, alternating direction per repeat
    cells = [
        (c, k, m)
        for c in concurrencies
        for k in range(repeats)
        for m in (modes if k % 2 == 0 else modes[::-1])
    ]
    single: list[dict] = []
    with tqdm(total=len(cells), unit="cell", desc="bench") as bar:
        for c, k, m in cells:
            r = run_cell(
                url, m, c, prompts, max_tokens, max(min_requests, 2 * c), time_limit, metrics_url, pgid,
                length_spread=length_spread,
            )  # fmt: skip
            single.append({**r, "repeat": k})
            bar.set_postfix(mode=m, c=c, agg=f"{r['aggregate_tps']:.1f}", user=f"{r['per_user_tps']:.1f}")
            bar.update()
            result.update(runs=combine(single), repeat_runs=single if repeats > 1 else [])
            result["goals"] = goals(result["runs"])
            if out is not None:  # partial results survive an interruption
                write(result, out)
    if out is not None:
        write(result, out)
        plots = plot(result, out.parent, out.stem)
        log(f"[bench] wrote {out}, {out.with_suffix('.csv')}, " + ", ".join(map(str, plots)))
    return result


def markdown(result: dict) -> str:
    """The sweep as markdown tables (docs/results.md): one table per concurrency."""
    runs = result["runs"]
    lines = []
    for c in sorted({r["concurrency"] for r in runs}):
        lines += [
            f"\n**{c} concurrent client{'s' if c > 1 else ''}**\n",
            "| mode | per-user tok/s | aggregate tok/s | TTFT p50 ms | ITL p50 / p99 ms | τ | mean ℓ "
            "| overhead | step ms (model / BLS / Python) | peak RSS MB |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in (r for r in runs if r["concurrency"] == c):
            step = _fmt(r.get("step_ms"), "{:.0f}")
            parts = "/".join(
                _fmt(r.get(k), "{:.0f}")
                for k in ("model_ms_per_step", "bls_transport_ms_per_step", "python_ms_per_step")
            )
            cells = [
                r["mode"],
                _fmt(r["per_user_tps"]),
                _fmt(r["aggregate_tps"]),
                _fmt(r["ttft_ms_p50"], "{:.0f}"),
                _fmt(r["itl_ms_p50"], "{:.0f}") + " / " + _fmt(r["itl_ms_p99"], "{:.0f}"),
                _fmt(r["tau"], "{:.2f}"),
                _fmt(r["mean_verify_len"], "{:.2f}"),
                _fmt(r["overhead"], "{:.0%}"),
                f"{step} ({parts})",
                _fmt(r["peak_rss_mb"], "{:.0f}"),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(v, fmt="{:.1f}") -> str:
    return "–" if v is None else fmt.format(v)
