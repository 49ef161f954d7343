"""Training the block drafters on the target cache (reference notes §2).

Per sequence: anchors sampled uniformly inside the answer (a with loss_mask[a] = loss_mask[a+1]
= 1); each anchor gets a block [x_a, MASK × (γ−1)] whose slot k predicts x_{a+k+1}; context
= target features at positions < a. Supervision is a contiguous prefix (a+k+1 must exist).

Losses (eqs. 9–12), position weights w_k = exp(−k/4) for 0-based slot k (exp(−(k−1)/4)
1-based; the code's decay 4.0, §11), normalised by Σ w over supervised slots:
  L_ce   = −log p^d(x*)                                     (skipped where x* is outside the draft vocabulary)
  L_tv   = ‖p^d − p^t‖_1 (the full L1 norm, = 2·TV)
  L_conf = BCE(σ(c_k), c*_k), c*_k = clamp(1 − ½‖p^d − p^t‖_1, 0, 1), detached
  DSpark: 0.1·L_ce + 0.9·L_tv + 1.0·L_conf;  DFlash: 1.0·L_ce
The target distribution p^t over the full vocabulary is never materialised: the cache holds
the final hidden state and the full-vocabulary logsumexp, so p^t on the draft vocabulary is
exp(h·E_v − lse) and the mass outside it is 1 − Σ.
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

from dspark.block_drafter import BlockDrafter

DECAY = 4.0


@dataclass
class Sequence:
    tokens: torch.Tensor  # [T] int64
    prompt_len: int
    features: torch.Tensor  # [T−1, F]
    last_hidden: torch.Tensor  # [T−1, d]
    lse: torch.Tensor  # [T−1]

    @classmethod
    def load(cls, path: Path) -> Sequence:
        z = np.load(path)
        return cls(
            torch.from_numpy(z["tokens"].astype(np.int64)),
            int(z["prompt_len"]),
            torch.from_numpy(z["features"]),
            torch.from_numpy(z["last_hidden"]),
            torch.from_numpy(z["lse"]),
        )


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


def position_weights(gamma: int) -> torch.Tensor:
    return torch.exp(-torch.arange(gamma, dtype=torch.float32) / DECAY)


@dataclass
class BlockBatch:
    """Blocks of one sequence, ready for the loss."""

    anchors: torch.Tensor  # [B] anchor positions a
    anchor_ids: torch.Tensor  # [B]
    prev: torch.Tensor  # [B, γ] teacher-forced previous tokens (target ids): x_{a+k}
    labels: torch.Tensor  # [B, γ] x_{a+k+1}
    valid: torch.Tensor  # [B, γ] bool, contiguous prefix
    hidden_idx: torch.Tensor  # [B, γ] position a+k of the target distribution for slot k


def make_blocks(seq: Sequence, n_anchors: int, gamma: int, gen: torch.Generator) -> BlockBatch | None:
    T, P = len(seq.tokens), seq.prompt_len
    cand = torch.arange(P, T - 1)  # anchor and its successor inside the answer
    if len(cand) == 0:
        return None
    a = cand[torch.randperm(len(cand), generator=gen)[:n_anchors]].sort().values
    k = torch.arange(gamma)
    pos = a.unsqueeze(1) + k  # a+k
    valid = (pos + 1) <= (T - 1)  # contiguous by construction
    prev = seq.tokens[pos.clamp(max=T - 1)]
    labels = seq.tokens[(pos + 1).clamp(max=T - 1)]
    return BlockBatch(a, seq.tokens[a], prev, labels, valid, pos.clamp(max=T - 2))


@dataclass
class LossOut:
    total: torch.Tensor
    ce: float
    tv: float
    conf: float
    accept: torch.Tensor  # [γ] sum of analytic acceptance 1 − ½L1 over supervised slots
    count: torch.Tensor  # [γ] supervised slots


def block_loss(model: BlockDrafter, seq: Sequence, blocks: BlockBatch) -> LossOut:
    cfg = model.cfg
    dtype = model.fc.weight.dtype
    n_ctx = len(seq.features)
    c = model.project_context(seq.features.unsqueeze(0))
    ctx_kv = model.context_kv(c, torch.arange(n_ctx).unsqueeze(0))
    ctx_ok = torch.arange(n_ctx).unsqueeze(0) < blocks.anchors.unsqueeze(1)
    U, h = model.backbone(blocks.anchor_ids, blocks.anchors, ctx_kv, ctx_ok)
    if cfg.head == "none":
        z, conf = U, None
    else:
        z, conf = model.teacher_forced(U, h, model.to_draft[blocks.prev])
    logp_d = torch.log_softmax(z.float(), dim=-1)  # [B, γ, Vd]
    p_d = logp_d.exp()
    with torch.no_grad():
        ht = seq.last_hidden[blocks.hidden_idx].to(dtype)
        p_t = torch.exp((ht @ model.lm_head.T).float() - seq.lse[blocks.hidden_idx].unsqueeze(-1))
        outside = (1.0 - p_t.sum(-1)).clamp(min=0.0)
    l1 = (p_d - p_t).abs().sum(-1) + outside  # ‖p^d − p^t‖_1 over the full vocabulary
    w = position_weights(cfg.block_size).unsqueeze(0) * blocks.valid
    norm = w.sum().clamp(min=1e-8)
    label_idx = model.to_draft[blocks.labels]
    in_vocab = label_idx < cfg.draft_vocab_size
    ce = -logp_d.gather(-1, label_idx.clamp(max=cfg.draft_vocab_size - 1).unsqueeze(-1)).squeeze(-1)
    ce = (ce * w * in_vocab).sum() / norm
    tv = (l1 * w).sum() / norm
    accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0)
    if cfg.kind == "dflash":
        total, lconf = ce, torch.zeros(())
    else:
        lconf = torch.nn.functional.binary_cross_entropy_with_logits(
            conf.float(), accept.detach(), reduction="none"
        )
        lconf = (lconf * w).sum() / norm
        total = 0.1 * ce + 0.9 * tv + 1.0 * lconf
    return LossOut(
        total,
        ce.item(),
        tv.item(),
        lconf.item(),
        (accept.detach() * blocks.valid).sum(0),
        blocks.valid.sum(0).float(),
    )


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
                loss=float(out.total), ce=out.ce, tv=out.tv, conf=out.conf, n=1, slots=int(out.count.sum())
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
