"""Draft-vocabulary size: coverage of held-out answer tokens vs the cost of the draft LM head.

    .venv/bin/python -m dspark.perf.draft_vocab_coverage [--answers artifacts/data/answers.jsonl]

Coverage: the frequency-ranked subset built from the training answers (as `dspark train`
does), measured on the held-out answers (5 % by key hash) — the tokens a drafter could ever
propose there. Cost: one drafter round's LM-head matmul (7 block positions × d → Vd) in
PyTorch, 2 threads, median of 50, next to one full-vocabulary LM head for the same rows.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from pathlib import Path

import torch

from dspark.training.data import read_answers
from dspark.training.pipeline import is_holdout
from dspark.training.train import build_draft_vocab


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--answers", default="artifacts/data/answers.jsonl")
    args = ap.parse_args()
    torch.set_num_threads(2)
    train, held = [], Counter()
    for a in read_answers(Path(args.answers)):
        if is_holdout(a["key"]):
            held.update(a["answer_ids"])
        else:
            train.append(a["answer_ids"])
    total = sum(held.values())
    print(f"{len(train)} training answers; held-out answers hold {total} tokens ({len(held)} distinct)")
    d, V = 576, 49152
    h = torch.randn(7, d)
    print("\n| draft vocab | held-out coverage | LM head, 7 rows (ms) |\n|---|---|---|")
    for size in (512, 1024, 2048, 4096, 8192, V):
        vocab, _ = build_draft_vocab(train, size, must_include=[2])
        chosen = set(vocab.tolist())
        cover = sum(n for t, n in held.items() if t in chosen) / total if size < V else 1.0
        w = torch.randn(size if size < V else V, d)
        times = []
        for _ in range(55):
            t = time.perf_counter()
            h @ w.T
            times.append(time.perf_counter() - t)
        label = f"{len(vocab)}" + (" (all seen)" if len(vocab) < size and size < V else "")
        label = "49152 (full)" if size == V else label
        print(f"| {label} | {cover:.1%} | {statistics.median(times[5:]) * 1000:.2f} |")


if __name__ == "__main__":
    main()
