"""Where a serving round's time goes outside the models: the orchestrator's engine over the
real services in one process (the same code as in tritonserver, minus BLS transport), under
cProfile. Prints the top functions by own time and the split model time vs the rest.

    python -m dspark.perf.orchestrator_profile --engines build/engines --mode dspark --tokens 48
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
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
    ap.add_argument("--concurrency", type=int, default=1)
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

    def call(model, inputs, outputs):
        t0 = time.perf_counter()
        res = services[model].handle(inputs)
        model_time[model] += time.perf_counter() - t0
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

    def run():
        sinks = []
        for i in range(args.concurrency):
            ids = orch.chat_ids(prompts[i % 3])
            req = Request(ids, args.tokens, SamplingParams(), frozenset(orch.limits.stop_ids))
            sinks.append(Sink())
            eng.submit(req, args.mode, sinks[-1])
        eng.run_until_idle()
        return sinks

    run()  # warm-up
    for k in model_time:
        model_time[k] = 0.0
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    sinks = run()
    prof.disable()
    wall = time.perf_counter() - t0
    rounds = sum(s.result.stats.rounds for s in sinks)
    models = sum(model_time.values())
    print(
        f"{args.mode}, {args.concurrency} request(s) × {args.tokens} tokens: {wall:.2f} s, {rounds} rounds; "
        f"models {models:.2f} s ({', '.join(f'{k} {v:.2f}' for k, v in model_time.items())}), "
        f"everything else {wall - models:.2f} s = {100 * (wall - models) / wall:.0f}% (profiler on)"
    )
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
    print(s.getvalue())


if __name__ == "__main__":
    main()
