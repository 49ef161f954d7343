"""Where a serving round's time goes outside the models: the orchestrator's engine over the
real services in one process (the same code as in tritonserver, minus BLS transport), under
cProfile. Prints the top functions by own time and the split model time vs the rest.

    python -m dspark.perf.orchestrator_profile --engines build/engines --mode dspark --tokens 48

With several modes (comma-separated) and no profiler, it compares what each costs outside the
models per batcher step, the modes interleaved over --repeats runs (issue 18: what a dspark-skip
round that drafts for nobody adds to an `off` round):

    python -m dspark.perf.orchestrator_profile --mode off,dspark-skip --concurrency 16 --requests 32 \
        --tokens 64 --repeats 3 --no-profile
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from pathlib import Path

from dspark.core.interfaces import Request
from dspark.core.sampling import SamplingParams
from dspark.models.loading import DEFAULT_TARGET
from dspark.prompts import eval_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="build/engines")
    ap.add_argument("--mode", default="dspark")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=1, help="requests decoding at once (slots)")
    ap.add_argument("--requests", type=int, default=0, help="requests per run (default: --concurrency)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per mode, modes interleaved")
    ap.add_argument("--no-profile", action="store_true", help="time without cProfile (comparisons)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()

    from dspark.model_repository.services import make_service
    from dspark.models.loading import target_dir
    from dspark.orchestrator.runtime import make_orchestrator, probe_sps

    params = {
        "engines_dir": str(Path(args.engines).resolve()),
        "target_dir": str(target_dir(DEFAULT_TARGET)),
        "num_slots": str(max(4, args.concurrency)),
        "max_len": "1024",
        "threads": str(args.threads),
        "runtime": "onnxruntime",
    }
    services = {
        k: make_service({**params, "service": k}) for k in ("target", "drafter_backbone", "drafter_head")
    }
    model_time = {k: 0.0 for k in services}
    calls = [0]

    def call(model, inputs, outputs):
        t0 = time.perf_counter()
        res = services[model].handle(inputs)
        model_time[model] += time.perf_counter() - t0
        calls[0] += 1
        return {k: res[k] for k in outputs}

    orch = make_orchestrator(params, call)
    eng = orch.batcher
    eng.set_sps(probe_sps(call))
    prompts = [eval_prompts(s, 1)[0] for s in ("gsm8k-test", "humaneval", "mt-bench")]

    class Sink:
        def tokens(self, t):
            pass

        def done(self, r):
            self.result = r

        def error(self, m):
            raise RuntimeError(m)

    def run(mode: str):
        sinks = []
        for i in range(args.requests or args.concurrency):
            ids = orch.chat_ids(prompts[i % 3])
            req = Request(ids, args.tokens, SamplingParams(), frozenset(orch.limits.stop_ids))
            sinks.append(Sink())
            eng.submit(req, mode, sinks[-1])
        eng.run_until_idle()
        return sinks

    modes = args.mode.split(",")
    for mode in modes:
        run(mode)  # warm-up (and each mode's prices measured)
    prof = None if args.no_profile else cProfile.Profile()
    # per mode, per run: wall seconds, model seconds, batcher steps, model calls
    seen: dict[str, list[tuple[float, float, int, int]]] = {m: [] for m in modes}
    for rep in range(args.repeats):
        for mode in modes if rep % 2 == 0 else modes[::-1]:
            for k in model_time:
                model_time[k] = 0.0
            calls[0], steps0 = 0, eng.rounds
            t0 = time.perf_counter()
            if prof is not None:
                prof.enable()
            sinks = run(mode)
            if prof is not None:
                prof.disable()
            wall = time.perf_counter() - t0
            steps = max(eng.rounds - steps0, 1)
            models = sum(model_time.values())
            seen[mode].append((wall, models, steps, calls[0]))
            if prof is not None:
                rounds = sum(s.result.stats.rounds for s in sinks)
                print(
                    f"{mode}, {len(sinks)} request(s) × {args.tokens} tokens: {wall:.2f} s, {rounds} rounds; "
                    f"models {models:.2f} s ({', '.join(f'{k} {v:.2f}' for k, v in model_time.items())}), "
                    f"everything else {wall - models:.2f} s = {100 * (wall - models) / wall:.0f}% "
                    "(profiler on)"
                )
    for mode, runs in seen.items():
        rest = [1e3 * (w - m) / n for w, m, n, _ in runs]
        model = 1e3 * statistics.median(m / n for _, m, n, _ in runs)
        print(
            f"{mode:>12}: outside the models {statistics.median(rest):.2f} ms per step "
            f"(runs: {', '.join(f'{x:.2f}' for x in rest)}), model {model:.1f} ms per step, "
            f"{statistics.median(c / n for *_, n, c in runs):.2f} model calls per step"
        )
    if prof is not None:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
        print(s.getvalue())


if __name__ == "__main__":
    main()
