"""PyTorch reference target (SmolLM2-135M-Instruct): prefill and batched decode throughput.

    .venv/bin/python perf/target_step_bench.py

For each (batch R, prompt length P): prefill R prompts one by one, then time 5 decode steps
of one token for all R sequences (best of 5). These numbers size the data-generation job.
"""

import time

import torch

from dspark.models.loading import load_target
from dspark.models.target import TargetRunner


def main() -> None:
    torch.set_num_threads(2)
    loaded = load_target()
    for R, P in [(1, 200), (16, 200), (16, 600), (32, 400)]:
        runner = TargetRunner(loaded.model, R, 1200)
        slots = [runner.allocate() for _ in range(R)]
        t = time.perf_counter()
        for s in slots:
            runner.step([s], [list(range(100, 100 + P))])
        prefill = R * P / (time.perf_counter() - t)
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            runner.step(slots, [[5]] * R)
            best = min(best, time.perf_counter() - t)
        print(
            f"R={R} P={P}: prefill {prefill:.0f} tok/s; "
            f"decode step {best * 1000:.0f} ms = {R / best:.0f} tok/s"
        )


if __name__ == "__main__":
    main()
