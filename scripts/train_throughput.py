"""Training-step throughput: supervised positions per second of CPU time (issue 12).

Runs the production training step (`model.loss` + backward + AdamW) of a freshly initialised
drafter on the first cached training sequences and prints one JSON line per kind. It measures
process CPU time, so a busy machine slows it less than wall time would (it still does somewhat).
The script uses only APIs that predate the faster step, so the "before" number is the same
script against an older checkout:

    .venv/bin/python scripts/train_throughput.py --kinds dspark --anchors 32
    git worktree add /tmp/before 0bbdff9^
    PYTHONPATH=/tmp/before .venv/bin/python scripts/train_throughput.py --kinds dspark --anchors 32
"""

import argparse
import json
import time
from pathlib import Path

import torch

from dspark.models.loading import load_target
from dspark.models.losses import Sequence, make_blocks
from dspark.training.data import read_answers
from dspark.training.pipeline import make_drafter
from dspark.training.train import build_draft_vocab


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="dspark,dflash,eagle3")
    ap.add_argument("--anchors", type=int, default=128, help="blocks per sequence")
    ap.add_argument("--seqs", type=int, default=2, help="sequences per optimizer step")
    ap.add_argument("--steps", type=int, default=6, help="timed steps (after one warm-up step)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache", default="artifacts/cache", help="target cache of `make data`")
    ap.add_argument("--answers", default="data/regenerated/answers.jsonl.gz")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    files = sorted(Path(args.cache).glob("*.npz"))[:16]
    if not files:
        raise SystemExit(f"no cached sequences in {args.cache}: run `make data` first")
    loaded = load_target()
    answers = [a["answer_ids"] for a in read_answers(Path(args.answers))]
    vocab, _ = build_draft_vocab(answers, 8192, must_include=sorted(loaded.stop_ids))
    seqs = [Sequence.load(f) for f in files]
    for kind in args.kinds.split(","):
        rate = positions_per_cpu_second(make_drafter(loaded, kind, vocab), seqs, args)
        row = {"kind": kind, "anchors": args.anchors, "threads": args.threads, "pos_per_cpu_s": rate}
        print(json.dumps(row), flush=True)


def positions_per_cpu_second(model, seqs, args) -> float:
    """Supervised draft slots per CPU second over args.steps optimizer steps (after one warm-up)."""
    torch.manual_seed(0)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    gen = torch.Generator().manual_seed(0)

    def step(i: int) -> int:
        opt.zero_grad()
        slots = 0
        for j in range(args.seqs):
            seq = seqs[(i * args.seqs + j) % len(seqs)]
            blocks = make_blocks(seq, args.anchors, model.cfg.block_size, gen)
            if blocks is None:
                continue
            out = model.loss(seq, blocks)
            (out.total / args.seqs).backward()
            slots += int(out.count.sum())
        opt.step()
        return slots

    step(0)
    t0 = time.process_time()
    total = sum(step(i) for i in range(1, args.steps + 1))
    return round(total / (time.process_time() - t0), 1)


if __name__ == "__main__":
    main()
