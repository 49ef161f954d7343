"""Training the drafters on the target cache (reference notes §2): the resumable loop.

Each step draws `seqs_per_step` cached samples and `anchors_per_seq` blocks from each
(dspark.models.losses.make_blocks), and minimises the model's own loss (`model.loss`:
dspark.models.losses for the block drafters, the TTT soft cross-entropy for EAGLE-3). AdamW,
warm-up then cosine, gradient clipping; a checkpoint every `ckpt_every` steps that the same
command resumes from (resumed training equals uninterrupted training).
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from dspark.models.block_drafter import BlockDrafter
from dspark.models.losses import Sequence, make_blocks


def build_draft_vocab(answer_token_lists, size: int, must_include=()) -> tuple[torch.Tensor, float]:
    """The `size` most frequent answer tokens (plus must_include), and their coverage."""
    counts = Counter()
    for ids in answer_token_lists:
        counts.update(ids)
    total = sum(counts.values())
    chosen = [t for t in must_include]
    for t, _ in counts.most_common():
        if len(chosen) >= size:
            break
        if t not in chosen:
            chosen.append(t)
    covered = sum(counts[t] for t in chosen)
    return torch.tensor(sorted(chosen), dtype=torch.long), covered / max(total, 1)


@dataclass
class TrainConfig:
    steps: int = 1000
    seqs_per_step: int = 8
    anchors_per_seq: int = 32
    lr: float = 6e-4
    warmup_frac: float = 0.04
    weight_decay: float = 0.0
    clip: float = 1.0
    seed: int = 42
    log_every: int = 10
    ckpt_every: int = 100


def lr_at(step: int, tc: TrainConfig) -> float:
    warm = max(1, int(tc.warmup_frac * tc.steps))
    if step < warm:
        return tc.lr * (step + 1) / warm
    progress = (step - warm) / max(1, tc.steps - warm)
    return tc.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def train(
    model: BlockDrafter,
    files: list[Path],
    tc: TrainConfig,
    out_dir: Path,
    log=print,
    until: int | None = None,
) -> dict:
    """Train (resuming from out_dir/ckpt.pt if present); returns the training summary.

    `until` stops (with a checkpoint) after that many steps in total, for runs split across
    sessions; the schedule is always the one of tc.steps."""
    out_dir.mkdir(parents=True, exist_ok=True)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=tc.lr, weight_decay=tc.weight_decay)
    gen = torch.Generator().manual_seed(tc.seed)
    ckpt = out_dir / "ckpt.pt"
    step, elapsed, history = 0, 0.0, []
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        step, elapsed, history = state["step"], state["elapsed"], state["history"]
        log(f"[train] resumed at step {step}/{tc.steps}")
    order = torch.randperm(len(files), generator=torch.Generator().manual_seed(tc.seed)).tolist()
    cursor = (step * tc.seqs_per_step) % len(files)
    gamma = model.cfg.block_size
    model.train()
    acc_sum, acc_cnt, run = torch.zeros(gamma), torch.zeros(gamma), Counter()
    t0 = time.perf_counter()
    last = min(tc.steps, until) if until is not None else tc.steps
    while step < last:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, tc)
        opt.zero_grad(set_to_none=True)
        n_seq = 0
        for _ in range(tc.seqs_per_step):
            seq = Sequence.load(files[order[cursor % len(files)]])
            cursor += 1
            blocks = make_blocks(seq, tc.anchors_per_seq, gamma, gen)
            if blocks is None:
                continue
            out = model.loss(seq, blocks)
            (out.total / tc.seqs_per_step).backward()
            n_seq += 1
            acc_sum += out.accept
            acc_cnt += out.count
            run.update(
                loss=out.total.item(), ce=out.ce, tv=out.tv, conf=out.conf, n=1, slots=int(out.count.sum())
            )
        torch.nn.utils.clip_grad_norm_(params, tc.clip)
        opt.step()
        step += 1
        if step % tc.log_every == 0 or step == tc.steps:
            alpha = (acc_sum / acc_cnt.clamp(min=1)).tolist()
            tau_prob = 1 + float(np.sum(np.cumprod(alpha)))
            n = max(run["n"], 1)
            dt = time.perf_counter() - t0
            rec = {
                "step": step,
                "lr": lr_at(step - 1, tc),
                "loss": run["loss"] / n,
                "ce": run["ce"] / n,
                "tv": run["tv"] / n,
                "conf": run["conf"] / n,
                "alpha": alpha,
                "tau_prob": tau_prob,
                "slots": run["slots"],
                "seconds": elapsed + dt,
            }
            history.append(rec)
            alphas = " ".join(f"{a:.2f}" for a in alpha)
            log(
                f"[train] step {step}/{tc.steps} loss {rec['loss']:.3f} "
                f"(ce {rec['ce']:.3f} tv {rec['tv']:.3f} conf {rec['conf']:.3f}) "
                f"τ_prob {tau_prob:.2f} α {alphas} [{elapsed + dt:.0f} s]"
            )
            acc_sum.zero_()
            acc_cnt.zero_()
            run.clear()
        if step % tc.ckpt_every == 0 or step == last:
            dt = time.perf_counter() - t0
            torch.save(
                {
                    "model": model.state_dict(),
                    "opt": opt.state_dict(),
                    "gen": gen.get_state(),
                    "step": step,
                    "elapsed": elapsed + dt,
                    "history": history,
                },
                ckpt,
            )
    model.eval()
    total_s = elapsed + time.perf_counter() - t0
    return {
        "train_config": asdict(tc),
        "steps": step,
        "seconds": total_s,
        "supervised_slots": sum(h["slots"] for h in history),
        "history": history,
    }


def save_summary(path: Path, summary: dict) -> None:
    path.write_text(json.dumps(summary, indent=2))
