"""`make soak` / `python -m dspark.perf.soak`: many streaming clients for a bounded time against a
real tritonserver on loopback, mixing what production traffic mixes (issue 16).

Each of `--clients` threads loops until the deadline (and at most MAX_REQUESTS_PER_CLIENT times),
picking per request:
  stream   a mode (dspark, dspark-skip, dspark-async, static:3, threshold:0.5, off), greedy or
           sampled (temperature / top-p / top-k, a seed); greedy requests use a fixed probe prompt
           whose uninterrupted answer is known, and their tokens are compared to it
  stop     the same with one or two stop strings (decoded characters the answer may contain)
  cancel   a stream cancelled by the client after a few tokens
  bad      a malformed request (one of BAD): it must get its field-specific error
Every 5 s a sampler records the RSS of tritonserver and each python stub, and the server's
active / queued sequences. At the end: slots still held once traffic stops (must be 0), RSS
growth after warm-up, p50 / p99 inter-token latency per time bin, errors by kind.

Writes results/soak.json and results/soak.png. Loopback only; every loop is bounded in count and
time. Engines: the test suite's tiny random engines (built here), decoded with the SmolLM2
tokenizer when it is cached (so stop strings match real text), else without text.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import threading
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from dspark.paths import REPO

MAX_REQUESTS_PER_CLIENT = 100_000
MODES = ["dspark", "dspark-skip", "dspark-async", "static:3", "threshold:0.5", "off"]
MIX = {"stream": 0.55, "stop": 0.15, "cancel": 0.15, "bad": 0.15}
# (inputs besides a valid prompt, what the error must say)
BAD = [
    ({"top_p": 2.0}, "top_p must be in"),
    ({"max_tokens": 0}, "max_tokens must be in"),
    ({"temperature": -1.0}, "temperature must be"),
    ({"mode": "turbo"}, "mode"),
    ({"input_ids": [1, 999]}, "input_ids must be in"),
    ({"stop": [f"s{i}" for i in range(20)]}, "stop: at most"),
    ({"stop": ["x" * 500]}, "stop: each stop string"),
    ({"input_ids": [1] * 140_000}, "request body: .* exceed the limit"),
]
EXPECTED = ("cancelled", "busy") + tuple(f"bad:{i}" for i in range(len(BAD)))
RESTART_MARGIN_S = 3.0  # a stream cut by a supervised restart fails at most this long around it
RESTART_SETTLE_S = 10.0  # RSS after a restart: the models' memory is still filling


def tiny_engines(dest: Path):
    """The test suite's tiny random target + DSpark drafter, built into ORT engines once."""
    sys.path.insert(0, str(REPO))
    from tests.unit.test_engines import _build, _target32

    target = _target32()
    if not (dest / "manifest.json").exists():
        _build(dest, "markov", target)
    return target


def tokenizer_dir() -> Path | None:
    try:
        from dspark.models.loading import target_dir

        return target_dir("smollm2-135m-instruct")
    except Exception:  # noqa: BLE001 - no cached/convertible SmolLM2: the soak runs without text
        return None


def process_rss(server_pid: int) -> dict[str, float]:
    """MB resident: tritonserver and each python-backend stub (by model)."""
    from dspark.serving.supervisor import stub_processes

    def rss(pid: int) -> float:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
        except OSError:
            pass
        return 0.0

    out = {"tritonserver": rss(server_pid)}
    for model, pids in stub_processes(server_pid).items():
        out[model] = sum(rss(p) for p in pids)
    return out


def _metrics(port: int) -> dict[str, float]:
    from dspark.orchestrator.metrics import parse_prometheus

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return parse_prometheus(r.read().decode())


def held(m: dict) -> dict[str, float]:
    return {
        "active": m.get('dspark_active_sequences{model="dspark"}', -1.0),
        "queued": m.get('dspark_queued_requests{model="dspark"}', -1.0),
        "target_sequences": m.get("dspark_target_sequences", -1.0),
        "drafter_sequences": m.get("dspark_drafter_backbone_sequences", -1.0),
    }


class Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outcomes: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.examples: dict[str, str] = {}
        self.itl: list[tuple[float, float]] = []  # (seconds since start, gap)
        self.tokens = 0
        self.mismatches = 0
        self.unexpected_at: list[tuple[float, str]] = []  # (seconds since start, error key)

    def count(self, outcome: str, error: str | None = None, example: str = "", t: float | None = None):
        with self.lock:
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
            if error is not None:
                self.errors[error] = self.errors.get(error, 0) + 1
                self.examples.setdefault(error, example[:300])
            if outcome == "unexpected" and error is not None and t is not None:
                self.unexpected_at.append((t, error))

    def excuse(self, windows: list[tuple[float, float]]) -> int:
        """Move the unexpected errors that happened inside a window (a supervised restart of
        tritonserver: its streams end with a transport error) to the outcome `lost_in_restart`;
        returns how many."""
        moved = 0
        with self.lock:
            keep = []
            for t, error in self.unexpected_at:
                if any(a <= t <= b for a, b in windows):
                    self.outcomes["unexpected"] -= 1
                    self.errors[error] -= 1
                    self.outcomes["lost_in_restart"] = self.outcomes.get("lost_in_restart", 0) + 1
                    moved += 1
                else:
                    keep.append((t, error))
            self.unexpected_at = keep
            self.outcomes = {k: v for k, v in self.outcomes.items() if v}
            self.errors = {k: v for k, v in self.errors.items() if v}
        return moved


def _stream(url, inputs, cancel_after=None, timeout=60.0):
    """One raw stream: (token ids, stats, error, arrival times); cancels after `cancel_after` tokens."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from dspark.serving.client import request_inputs

    done, got = threading.Event(), {"ids": [], "stats": None, "err": None, "t": []}

    def cb(result=None, error=None):
        if done.is_set():  # after the final response or the client's own cancel: not ours
            return
        if error is not None:
            got["err"] = str(error)
            done.set()
            return
        ids, stats = result.as_numpy("token_ids"), result.as_numpy("stats")
        if ids is not None and len(ids):
            got["ids"] += ids.tolist()
            got["t"].append((time.perf_counter(), len(ids)))
            if cancel_after is not None and len(got["ids"]) >= cancel_after:
                done.set()
        if stats is not None and len(stats):
            got["stats"] = json.loads(stats[0])
        if result.get_response().parameters["triton_final_response"].bool_param:
            done.set()

    c = grpcclient.InferenceServerClient(url)
    t0 = time.perf_counter()
    finished = False
    try:
        c.start_stream(callback=cb)
        c.async_stream_infer(
            "dspark", request_inputs(grpcclient, **inputs), request_id="s", enable_empty_final_response=True
        )
        finished = done.wait(timeout)
    except InferenceServerException as e:  # the stream died before the request went out
        got["err"] = got["err"] or str(e)
        finished = True
    finally:
        try:
            c.stop_stream(cancel_requests=cancel_after is not None or not finished)
        except Exception:  # noqa: BLE001
            pass
        c.close()
    if not finished and got["err"] is None:
        got["err"] = f"no final response within {timeout:.0f} s"
    return got, t0


def _request(rng: random.Random, probes, alphabet: str, vocab: int, max_tokens: int):
    kind = rng.choices(list(MIX), weights=list(MIX.values()))[0]
    mode = rng.choice(MODES)
    base = dict(text=None, mode=mode, temperature=0.0, top_p=1.0, top_k=0, seed=None, stop=None)
    if kind == "bad":
        i = rng.randrange(len(BAD))
        inputs = {**base, "input_ids": [5, 6, 7], "max_tokens": 8}
        inputs.update(BAD[i][0])
        return kind, i, inputs, None
    if rng.random() < 0.5:  # greedy on a probe prompt: the answer is known
        p = rng.randrange(len(probes))
        prompt, expect = probes[p]
        inputs = {**base, "input_ids": prompt, "max_tokens": max_tokens}
    else:
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(3, 20))]
        inputs = {**base, "input_ids": prompt, "max_tokens": rng.randint(8, max_tokens)}
        inputs.update(
            temperature=rng.choice([0.7, 1.0]), top_p=rng.choice([0.9, 1.0]), top_k=rng.choice([0, 20])
        )
        inputs["seed"] = rng.randrange(1 << 30)
        expect = None
    if kind == "stop" and alphabet:
        inputs["stop"] = [
            rng.choice(alphabet) + rng.choice(["", rng.choice(alphabet)]) for _ in range(rng.randint(1, 2))
        ]
        expect = None  # the answer may end early at a stop string
    return kind, None, inputs, expect


def _client(url, rng, deadline, stats, probes, alphabet, vocab, max_tokens, t_start) -> None:
    for _ in range(MAX_REQUESTS_PER_CLIENT):
        if time.monotonic() >= deadline:
            return
        kind, bad, inputs, expect = _request(rng, probes, alphabet, vocab, max_tokens)
        cancel_after = rng.randint(1, 4) if kind == "cancel" else None
        got, t0 = _stream(url, inputs, cancel_after)
        err = got["err"]
        if kind == "bad":
            want = BAD[bad][1]
            if err is not None and re.search(want, err):
                stats.count("bad_rejected", f"bad:{bad}", err)
            else:
                stats.count(
                    "unexpected",
                    f"bad:{bad}:accepted" if err is None else "bad:wrong_error",
                    str(err),
                    t=time.perf_counter() - t_start,
                )
            continue
        if err is not None:
            key = (
                "busy"
                if "busy" in err
                else ("cancelled" if kind == "cancel" and "cancel" in err.lower() else "error")
            )
            stats.count(
                "cancelled" if key == "cancelled" else ("busy" if key == "busy" else "unexpected"),
                key,
                err,
                t=time.perf_counter() - t_start,
            )
            if key == "error":  # e.g. the server is restarting: back off as a real client would
                time.sleep(0.25)
            continue
        if kind == "cancel" and (got["stats"] is None):
            stats.count("cancelled", "cancelled")
            continue
        times = got["t"]
        with stats.lock:
            stats.tokens += len(got["ids"])
            for (ta, _), (tb, n) in zip(times, times[1:]):
                gap = (tb - ta) / n
                stats.itl.extend([(tb - t_start, gap)] * n)
            if expect is not None and got["ids"] != expect:
                stats.mismatches += 1
        stats.count(f"{kind}_finished" if kind != "cancel" else "cancel_finished_first")


def _percentile(xs, q):
    return float(np.percentile(xs, q)) if xs else None


def run_soak(
    minutes: float = 10.0,
    clients: int = 32,
    out: Path = REPO / "results" / "soak.json",
    work: Path = REPO / "build" / "soak",
    engines: Path | None = None,
    bin_seconds: float = 60.0,
    sample_seconds: float = 5.0,
    warmup_fraction: float = 0.2,
    slots: int = 16,
    max_tokens: int = 40,  # + a prompt of at most 20 tokens: within the tiny engines' 64
    seed: int = 0,
    log=print,
    supervise: bool = True,
    inject_segfault_at: float | None = None,
) -> dict:
    import torch

    from dspark.core.interfaces import Request
    from dspark.core.reference import generate
    from dspark.model_repository.render import render
    from dspark.models.target import TargetRunner
    from dspark.orchestrator.text import ChatTokenizer
    from dspark.perf.sps import machine
    from dspark.serving.faults import segfault_python_backend
    from dspark.serving.launcher import Server, ServerError, free_port
    from dspark.serving.supervisor import Supervisor

    work.mkdir(parents=True, exist_ok=True)
    engines = engines or work / "engines"
    target = tiny_engines(engines)
    vocab = target.cfg.vocab_size
    tdir = tokenizer_dir()
    alphabet = ""
    if tdir is not None:
        text = ChatTokenizer(tdir).decode(list(range(3, vocab)))
        alphabet = "".join(ch for ch in text if ch.isprintable() and not ch.isspace())
    g = torch.Generator().manual_seed(seed)
    probes = []
    for i in range(8):
        prompt = torch.randint(1, vocab, (3 + i,), generator=g).tolist()
        ref = generate(TargetRunner(target, 1, 96), [Request(prompt, max_tokens, stop_ids=frozenset({0}))])[0]
        probes.append((prompt, ref.tokens))
    models = render("cpu", work / "repo", engines, tdir, num_slots=slots, max_len=96, threads=1, max_queue=64)
    server = Server(
        work / "repo", models, free_port(), free_port(), free_port(), log_path=work / "server.log"
    )
    stats, samples = Stats(), []
    log(f"[soak] {clients} clients for {minutes:g} min on 127.0.0.1 (tiny engines; log {server.log_path})")
    with server:
        url = f"127.0.0.1:{server.grpc_port}"
        _stream(url, dict(text=None, input_ids=[5, 6, 7], max_tokens=4, mode="dspark", temperature=0.0,
                          top_p=1.0, top_k=0, seed=None, stop=None))  # first request: SPS probe  # fmt: skip
        t_start = time.monotonic()
        t_perf = time.perf_counter()
        deadline = t_start + minutes * 60
        stop_sampler = threading.Event()

        def sampler():
            while not stop_sampler.is_set():
                try:
                    m = held(_metrics(server.metrics_port))
                except OSError:
                    m = {}
                samples.append({"t": time.monotonic() - t_start, "rss_mb": process_rss(server.proc.pid), **m})
                stop_sampler.wait(sample_seconds)

        # as under `dspark serve`: a python-backend abort of tritonserver is restarted on the same
        # ports; any other exit ends the soak (ServerError below)
        supervisor = Supervisor(server, log=log) if supervise else None
        restarts: list[dict] = []
        died: dict = {}

        def watch():
            while not stop_sampler.is_set():
                if not server.alive():
                    t_down = time.perf_counter() - t_perf
                    code, tail = server.proc.returncode, server.run_log()[-3000:]
                    if supervisor is not None and supervisor.after_exit(code):
                        up = time.perf_counter() - t_perf
                        restarts.append(
                            dict(down_s=round(t_down, 2), up_s=round(up, 2), exit_code=code, log_tail=tail)
                        )
                        continue
                    died.update(code=code, t=t_down, tail=tail)
                    return
                if supervisor is not None:  # a dead stub: a drafter reloaded, else tritonserver restarted
                    t_check = time.perf_counter() - t_perf
                    dead = supervisor.check()
                    if dead:
                        up = time.perf_counter() - t_perf
                        restarts.append(dict(down_s=round(t_check, 2), up_s=round(up, 2), stubs=dead))
                stop_sampler.wait(0.5)

        common = (deadline, stats, probes, alphabet, vocab, max_tokens, t_perf)
        threads = [
            threading.Thread(target=_client, args=(url, random.Random(seed * 1000 + i), *common), daemon=True)
            for i in range(clients)
        ]
        st = threading.Thread(target=sampler, daemon=True)
        st.start()
        wt = threading.Thread(target=watch, daemon=True)
        wt.start()
        injected: dict = {}
        if inject_segfault_at is not None:  # what the python backend does on its own, on purpose

            def inject():
                if not stop_sampler.wait(inject_segfault_at) and server.alive():
                    injected.update(
                        t=round(time.perf_counter() - t_perf, 2), tid=segfault_python_backend(server.proc.pid)
                    )
                    log(f"[soak] {injected['t']:.0f} s: SIGSEGV to python-backend thread {injected['tid']}")

            threading.Thread(target=inject, daemon=True).start()
        for t in threads:
            t.start()
        next_log = t_start + 60
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline + 120:
            time.sleep(1.0)
            if time.monotonic() >= next_log:
                next_log += 60
                with stats.lock:
                    log(f"[soak] {time.monotonic() - t_start:5.0f} s: {dict(sorted(stats.outcomes.items()))}")
        hung = sum(t.is_alive() for t in threads)
        wt.join(0.1)
        if died or not server.alive():
            stop_sampler.set()
            raise ServerError(
                f"tritonserver died during the soak (exit code {died.get('code', server.proc.returncode)}, "
                f"{died.get('t', time.perf_counter() - t_perf):.0f} s in; outcomes {dict(stats.outcomes)}); "
                f"its log {server.log_path} ends with:\n{died.get('tail') or server.log_tail()}"
            )
        # slots once traffic has stopped (bounded wait for the last cancellations to be noticed)
        settle = time.monotonic() + 30
        while True:
            try:
                end = held(_metrics(server.metrics_port))
            except OSError:  # mid-restart: the watch brings it back
                end = {"unreachable": 1.0}
            if all(v == 0 for v in end.values()) or time.monotonic() > settle:
                break
            time.sleep(0.5)
        stop_sampler.set()
        st.join(10)
        wt.join(30)
        samples.append({"t": time.monotonic() - t_start, "rss_mb": process_rss(server.proc.pid), **end})
    # streams cut by a supervised restart end with a transport error: from the death (the watch
    # sees it within 0.5 s) to a few seconds after the server is ready again
    windows = [(r["down_s"] - RESTART_MARGIN_S, r["up_s"] + RESTART_MARGIN_S) for r in restarts]
    lost = stats.excuse(windows)
    result = summarize(stats, samples, minutes, clients, bin_seconds, warmup_fraction, end, hung, windows)
    result["restarts"] = restarts
    result["injected_segfault"] = injected or None
    result["lost_in_restart"] = lost
    result["verdict"]["no_restart"] = not restarts
    result.update(
        machine=machine(),
        date=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        command=f"python -m dspark.perf.soak --minutes {minutes:g} --clients {clients}"
        + (f" --inject-segfault-at {inject_segfault_at:g}" if inject_segfault_at is not None else ""),
        engines="tiny random target (vocab 61) + DSpark drafter, ORT, 16 slots",
        tokenizer=str(tdir) if tdir else None,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    log(f"[soak] wrote {out} and {out.with_suffix('.png')}")
    return result


def summarize(
    stats: Stats, samples, minutes, clients, bin_seconds, warmup_fraction, end, hung, windows=()
) -> dict:
    """`windows`: (start, end) seconds of supervised restarts; RSS sampled in one (processes gone or
    still loading) or in the RESTART_SETTLE_S after it says nothing about a leak."""
    duration = minutes * 60
    warm = warmup_fraction * duration
    totals = [
        (s["t"], sum(s["rss_mb"].values()))
        for s in samples
        if not any(a <= s["t"] <= b + RESTART_SETTLE_S for a, b in windows)
    ]
    after = [r for t, r in totals if t >= warm]
    base = float(np.mean(after[: max(1, len(after) // 10)])) if after else None
    last = float(np.mean(after[-max(1, len(after) // 10) :])) if after else None
    growth = (last - base) / base if base else None
    bins = []
    for k in range(int(np.ceil(duration / bin_seconds))):
        xs = [gap for t, gap in stats.itl if k * bin_seconds <= t < (k + 1) * bin_seconds]
        bins.append(
            {
                "start_s": k * bin_seconds,
                "itl_ms_p50": None if not xs else round(1000 * _percentile(xs, 50), 2),
                "itl_ms_p99": None if not xs else round(1000 * _percentile(xs, 99), 2),
                "tokens": len(xs),
            }
        )
    steady = [b for b in bins if b["start_s"] >= warm and b["itl_ms_p50"] is not None]
    drift = steady[-1]["itl_ms_p50"] / steady[0]["itl_ms_p50"] if len(steady) >= 2 else None
    unexpected = {k: v for k, v in stats.errors.items() if k not in EXPECTED}
    slots_end = {k: v for k, v in end.items()}
    return {
        "minutes": minutes,
        "clients": clients,
        "requests": sum(stats.outcomes.values()),
        "outcomes": dict(sorted(stats.outcomes.items())),
        "errors_by_kind": dict(sorted(stats.errors.items())),
        "unexpected_errors": unexpected,
        "error_examples": stats.examples,
        "greedy_mismatches": stats.mismatches,
        "tokens": stats.tokens,
        "hung_clients": hung,
        "slots_held_at_end": slots_end,
        "rss": {
            "warmup_s": warm,
            "after_warmup_mb": base,
            "end_mb": last,
            "growth": growth,
            "samples": [
                {"t": round(s["t"], 1), **{k: round(v, 1) for k, v in s["rss_mb"].items()}} for s in samples
            ],
        },
        "sequences": [
            {"t": round(s["t"], 1), "active": s.get("active"), "queued": s.get("queued")} for s in samples
        ],
        "itl_per_bin": bins,
        "bin_seconds": bin_seconds,
        "itl_p50_drift": drift,
        "verdict": {
            "rss_growth_le_5pct": growth is not None and growth <= 0.05,
            "slots_held_at_end_0": all(v == 0 for v in slots_end.values()),
            "only_expected_errors": not unexpected,
            "greedy_output_equal": stats.mismatches == 0,
            "no_itl_drift_le_25pct": drift is not None and drift <= 1.25,
            "no_hung_client": hung == 0,
        },
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    samples = result["rss"]["samples"]
    t = [s["t"] / 60 for s in samples]
    names = [k for k in samples[0] if k != "t"] if samples else []
    for n in names:
        ax[0].plot(t, [s.get(n, 0) for s in samples], label=n)
    ax[0].plot(t, [sum(v for k, v in s.items() if k != "t") for s in samples], "k-", lw=2, label="total")
    ax[0].axvline(result["rss"]["warmup_s"] / 60, color="grey", ls=":")
    g = result["rss"]["growth"]
    ax[0].set_ylabel("RSS (MB)")
    ax[0].set_title(f"RSS: growth after warm-up {100 * g:+.1f}%" if g is not None else "RSS")
    ax[0].legend(fontsize=7, ncol=3)
    bins = [b for b in result["itl_per_bin"] if b["itl_ms_p50"] is not None]
    bt = [(b["start_s"] + result["bin_seconds"] / 2) / 60 for b in bins]
    ax[1].plot(bt, [b["itl_ms_p50"] for b in bins], "o-", label="p50")
    ax[1].plot(bt, [b["itl_ms_p99"] for b in bins], "s-", label="p99")
    ax[1].set_ylabel("inter-token latency (ms)")
    ax[1].legend(fontsize=7)
    seq = result["sequences"]
    ax[2].plot([s["t"] / 60 for s in seq], [s["active"] for s in seq], label="active")
    ax[2].plot([s["t"] / 60 for s in seq], [s["queued"] for s in seq], label="queued")
    ax[2].set_ylabel("sequences")
    ax[2].set_xlabel("minutes")
    ax[2].legend(fontsize=7)
    fig.suptitle(
        f"soak: {result['clients']} clients, {result['minutes']:g} min, {result['requests']} requests\n"
        f"{result.get('machine', '')} · {result.get('date', '')}",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark.perf.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--out", default=str(REPO / "results" / "soak.json"))
    ap.add_argument("--bin-seconds", type=float, default=60.0)
    ap.add_argument(
        "--inject-segfault-at", type=float, metavar="S",
        help="S seconds in, send SIGSEGV to a python-backend thread of tritonserver (what tritonserver "
        "2.51 does on its own under load): checks that the supervised restart loses only the "
        "streams it cuts",
    )  # fmt: skip
    args = ap.parse_args(argv)
    res = run_soak(
        args.minutes, args.clients, Path(args.out), bin_seconds=args.bin_seconds,
        inject_segfault_at=args.inject_segfault_at,
    )  # fmt: skip
    keys = ("requests", "outcomes", "slots_held_at_end", "restarts", "lost_in_restart", "verdict")
    print(json.dumps({k: res[k] for k in keys}, indent=1))
    print(
        f"[soak] RSS growth after warm-up {res['rss']['growth']:+.2%}; ITL p50 drift {res['itl_p50_drift']}"
    )
    return 0 if all(res["verdict"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
