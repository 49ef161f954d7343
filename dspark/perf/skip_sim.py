"""dspark-skip's planner, replayed offline on recorded drafting rounds (issue 18).

Serving cells on this VM differ by 10–35% run to run, so a planner change worth 2–5% cannot be
seen in one sweep. This tool separates the decision from the noise:

  record    runs the eval prompts in-process (ORT engines, the shipped drafter, its STS) with
            every draft verified (static:7) and keeps, per round, the anchor position, the
            calibrated confidences and the accepted prefix length;
  simulate  replays them at c concurrent requests (closed loop, a new request when one ends,
            round-robin over the sets) under off, always-draft and the SkipPlanner, with prices
            given in milliseconds: a target step of `--step-ms` at one token, shaped by the SPS
            table; a draft call of `--price-ms` for one request, shaped by the engine bench's
            drafter-round times per batch. Prints the throughput ratio to off per concurrency.

A request that drafts at committed position c uses the recorded round that started at or before
c, shifted by the difference (its accepted prefix shortened by as much; past the recorded
stretch, a poor one): conservative where the planner drafts out of step with the recording.

    python -m dspark.perf.skip_sim record --engines build/engines --out results/skip-traces.json
    python -m dspark.perf.skip_sim simulate --traces results/skip-traces.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

SETS = ["gsm8k-test", "humaneval", "mt-bench"]


def record(engines: str, per_set: int, max_tokens: int, out: Path) -> None:
    import torch

    from dspark.core.calibration import STS, sigmoid
    from dspark.core.interfaces import Request
    from dspark.core.reference import generate
    from dspark.core.sampling import SamplingParams
    from dspark.core.scheduler import Static
    from dspark.engines.ort import OrtDrafterRunner, OrtTargetRunner, session
    from dspark.models.loading import load_target
    from dspark.prompts import eval_prompts

    torch.set_num_threads(1)
    loaded = load_target()
    folder = Path(engines)
    target = OrtTargetRunner(session(folder / "target.opt.onnx", 1), loaded.model.cfg, 1, 2048)
    drafter = OrtDrafterRunner.load(folder, num_slots=1, threads=1)
    meta = json.loads((folder / "drafter_meta.json").read_text())
    sts = STS.from_dict(meta["sts"]) if meta.get("sts") else None
    traces, t0 = [], time.perf_counter()
    for name in SETS:
        for i, prompt in enumerate(eval_prompts(name, per_set)):
            req = Request(loaded.chat_ids(prompt), max_tokens, SamplingParams(), stop_ids=loaded.stop_ids)
            res = generate(target, [req], drafter, Static(7), sts)[0]
            rounds, c = [], 1
            for t in res.trace:
                conf = sts.apply(t.conf_logits) if sts else sigmoid(t.conf_logits)
                if t.verified == 7:  # a full block: its accepted prefix is the drafter's own
                    rounds.append({"at": c, "accepted": int(t.accepted), "conf": np.round(conf, 4).tolist()})
                c += int(t.accepted) + 1
            traces.append({"set": name, "prompt": i, "tokens": len(res.tokens), "rounds": rounds})
            print(
                f"[skip_sim] {name} #{i}: {len(rounds)} rounds ({time.perf_counter() - t0:.0f} s)", flush=True
            )
    meta = {"engines": engines, "max_tokens": max_tokens, "per_set": per_set, "policy": "static:7"}
    out.write_text(json.dumps({"meta": meta, "traces": traces}))
    print(f"[skip_sim] wrote {out}")


def _price_shape(engine_bench: Path) -> tuple[np.ndarray, np.ndarray]:
    """Drafter-round time per batch, relative to one request (results/engine_bench.json)."""
    rows = [r for r in json.loads(engine_bench.read_text())["rows"] if "batch" in r]
    b = np.array([r["batch"] for r in rows], np.float64)
    t = np.array([r["onnxruntime"] for r in rows], np.float64)
    return b, t / t[b == 1][0]


class Replay:
    def __init__(self, traces: list[dict], sps, step_ms: float, price_ms: float, shape) -> None:
        self.traces = traces
        self.order = sorted(
            range(len(traces)), key=lambda i: (traces[i]["prompt"], SETS.index(traces[i]["set"]))
        )
        self.at = [np.array([r["at"] for r in t["rounds"]]) for t in traces]
        scale = step_ms / 1000 / float(sps.step_times(np.array([1]))[0])
        self.step = lambda b: sps.step_times(b) * scale
        self.price = lambda n: np.interp(n, shape[0], shape[1]) * price_ms / 1000
        self.sps = sps

    def _round(self, q: int, c: int) -> tuple[np.ndarray, int]:
        """(confidences, accepted prefix) of drafting at committed position c of trace q."""
        rounds, k = self.traces[q]["rounds"], max(int(np.searchsorted(self.at[q], c, side="right")) - 1, 0)
        if not rounds:
            return np.full(7, 0.3), 0
        shift = c - rounds[k]["at"]
        conf = np.asarray(rounds[k]["conf"])
        if shift >= len(conf):
            return np.full(len(conf), 0.3), 0
        return np.concatenate([conf[shift:], np.full(shift, conf[-1])]), max(rounds[k]["accepted"] - shift, 0)

    def run(
        self, C: int, mode: str, requests: int, max_tokens: int, observe: bool = True
    ) -> tuple[float, float]:
        """(tokens per second, share of rounds with a draft call) of one closed-loop run."""
        from dspark.core.scheduler import DSparkSkip, SkipPlanner

        policy = DSparkSkip(self.sps)
        planner = SkipPlanner(policy)
        started, active, seconds, tokens, rounds, drafting_rounds = 0, [], 0.0, 0, 0, 0

        def new() -> dict:
            nonlocal started
            q = self.order[started % len(self.order)]
            started += 1
            return {"rid": started, "q": q, "c": 1, "last": np.full(7, np.nan)}

        while started < min(C, requests):
            active.append(new())
        while active:
            rounds += 1
            R = len(active)
            avail = np.array([max(min(7, max_tokens - a["c"] - 1), 0) for a in active])
            if mode == "off":
                mask = np.zeros(R, bool)
            elif mode == "always":
                mask = avail > 0
            else:
                last = np.stack([a["last"] for a in active])
                mask = planner.choose(
                    rounds, [a["rid"] for a in active], last, avail, self.price, None, self.step
                )
            rows = np.flatnonzero(mask & (avail > 0))
            got = np.ones(R, np.int64)
            ells = np.zeros(R, np.int64)
            if len(rows):
                drawn = [self._round(active[i]["q"], active[i]["c"]) for i in rows]
                ells[rows] = policy.schedule(np.stack([d[0] for d in drawn]), avail[rows])
                for i, (conf, acc) in zip(rows, drawn):
                    got[i] += min(acc, int(ells[i]))
                    active[i]["last"] = conf
            plain = float(self.step(np.array([R]))[0])
            t = float(self.step(np.array([R + ells.sum()]))[0]) + (
                float(self.price(len(rows))) if len(rows) else 0.0
            )
            if len(rows):
                drafting_rounds += 1
                if observe:
                    planner.observe(int((got - 1).sum()), R, t - plain, plain)
            seconds += t
            tokens += int(got.sum())
            keep = []
            for a, g in zip(active, got):
                a["c"] += int(g)
                if a["c"] >= min(self.traces[a["q"]]["tokens"], max_tokens):
                    planner.forget(a["rid"])
                    if started < requests:
                        keep.append(new())
                else:
                    keep.append(a)
            active = keep
        return tokens / seconds, drafting_rounds / rounds


def simulate(args) -> None:
    from dspark.core.sps import SPSTable

    data = json.loads(Path(args.traces).read_text())
    sps = SPSTable.from_json(args.sps)
    shape = _price_shape(Path(args.engine_bench))
    replay = Replay(data["traces"], sps, args.step_ms, args.price_ms, shape)
    conc = [int(c) for c in args.concurrency.split(",")]
    print(f"step {args.step_ms} ms at one token, draft call {args.price_ms} ms for one request, ", end="")
    print(f"{args.max_tokens} tokens per request")
    print("| clients | always draft / off | dspark-skip / off | draft rounds |", end=" ")
    print("without the measured return | draft rounds |\n|---|---|---|---|---|---|")
    for C in conc:
        n = max(args.requests, 10 * C)
        off, _ = replay.run(C, "off", n, args.max_tokens)
        always, _ = replay.run(C, "always", n, args.max_tokens)
        skip, share = replay.run(C, "skip", n, args.max_tokens)
        blind, blind_share = replay.run(C, "skip", n, args.max_tokens, observe=False)
        cells = [always / off, skip / off, share, blind / off, blind_share]
        print(f"| {C} | " + " | ".join(f"{v:.3f}" for v in cells) + " |", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="record drafting rounds on the eval prompts (in-process, ORT)")
    r.add_argument("--engines", default="build/engines")
    r.add_argument("--per-set", type=int, default=12)
    r.add_argument("--max-tokens", type=int, default=96)
    r.add_argument("--out", default="results/skip-traces.json")
    s = sub.add_parser("simulate", help="replay the recorded rounds under the planners")
    s.add_argument("--traces", default="results/skip-traces.json")
    s.add_argument("--sps", default="results/sps.json")
    s.add_argument("--engine-bench", default="results/engine_bench.json")
    s.add_argument("--step-ms", type=float, default=34.0)
    s.add_argument("--price-ms", type=float, default=15.0)
    s.add_argument("--concurrency", default="1,2,4,8,16")
    s.add_argument("--requests", type=int, default=48)
    s.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    if args.cmd == "record":
        record(args.engines, args.per_set, args.max_tokens, Path(args.out))
    else:
        simulate(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
