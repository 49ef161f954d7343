"""The drafters' training losses, on blocks drawn from a cached target pass (reference notes §2).

A cached sample (`Sequence`) holds the tokens, the target's tapped features, its final hidden
state and full-vocabulary logsumexp at every fed position. `make_blocks` draws anchors inside
the answer; each anchor gets a block [x_a, MASK × (γ−1)] whose slot k predicts x_{a+k+1};
context = target features at positions < a. Supervision is a contiguous prefix (a+k+1 must exist).

Block drafter losses (eqs. 9–12), position weights w_k = exp(−k/4) for 0-based slot k
(exp(−(k−1)/4) 1-based; the code's decay 4.0, §11), normalised by Σ w over supervised slots:
  L_ce   = −log p^d(x*)                                     (skipped where x* is outside the draft vocabulary)
  L_tv   = ‖p^d − p^t‖_1 (the full L1 norm, = 2·TV)
  L_conf = BCE(σ(c_k), c*_k), c*_k = clamp(1 − ½‖p^d − p^t‖_1, 0, 1), detached
  DSpark: 0.1·L_ce + 0.9·L_tv + 1.0·L_conf;  DFlash: 1.0·L_ce
The target distribution p^t over the full vocabulary is never materialised: the cache holds
the final hidden state and the full-vocabulary logsumexp, so p^t on the draft vocabulary is
exp(h·E_v − lse) and the mass outside it is 1 − Σ (`target_probs`, shared with EAGLE-3's loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from dspark.models.block_drafter import BlockDrafter

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


@torch.no_grad()
def target_probs(seq: Sequence, blocks: BlockBatch, lm_head: torch.Tensor, dtype: torch.dtype):
    """p^t on the draft vocabulary at each block slot ([B, γ, Vd], from the cached final hidden
    state and full-vocabulary logsumexp) and the target's mass outside it ([B, γ]). Overlapping
    blocks share positions (with dense anchors each position is in up to γ blocks): p^t is
    computed once per distinct position and gathered."""
    pos, inv = torch.unique(blocks.hidden_idx, return_inverse=True)
    ht = seq.last_hidden[pos].to(dtype)
    p_u = torch.exp((ht @ lm_head.T).float() - seq.lse[pos].unsqueeze(-1))  # [U, Vd]
    out_u = (1.0 - p_u.sum(-1)).clamp(min=0.0)
    return p_u[inv], out_u[inv]


def l1_distance(p_d: torch.Tensor, p_t: torch.Tensor, outside: torch.Tensor) -> torch.Tensor:
    """‖p^d − p^t‖_1 over the full vocabulary (p^d is zero outside the draft vocabulary)."""
    return (p_d - p_t).abs().sum(-1) + outside


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
    p_t, outside = target_probs(seq, blocks, model.lm_head, dtype)
    l1 = l1_distance(logp_d.exp(), p_t, outside)
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
