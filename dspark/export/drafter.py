"""The DSpark drafter's graphs: context, backbone (per batch bucket) and sequential head.

The drafter's per-sequence context cache (per layer, keys/values of the projected target
features of committed positions) lives with the caller in preallocated slots of a fixed
`max_context`, exactly like the target's KV cache; the graphs never return the whole cache.

drafter_context (dynamic R, T) — a prompt's features into the cache:
  features float32 [R, T, F], positions int64 [R, T]
  → ctx_key.{i}, ctx_value.{i} float32 [R, KV, T, D]

drafter_backbone (static batch bucket B, new positions M = γ + 1, block γ; the cached context
S is padded by the runner to a context bucket — 256, 512, … max_context — so the graph has S
as its one dynamic axis and a TensorRT build gets one optimization profile per context bucket):
  anchor_ids int64 [B]           the last committed token of each sequence
  ctx_len    int64 [B]           cached context positions (the first ctx_len of S are valid, S ≤ max_context)
  new_features float32 [B, M, F] features of the tokens committed last round (≤ M of them)
  new_count  int64 [B]           how many of the M rows are real
  ctx_key.{i}, ctx_value.{i} float32 [B, KV, S, D]
  → base_logits float32 [B, γ, Vd]  (U_k over the draft vocabulary)
    hidden      float32 [B, γ, d]   (h_k)
    new_ctx_key.{i}, new_ctx_value.{i} float32 [B, KV, M, D]  (to append at ctx_len)
  The anchor sits at position ctx_len + new_count. Rows with ctx_len = new_count = 0 are
  padding (they attend only to their own block) and are ignored by the caller.

drafter_head (static batch bucket B) — one sequential step, run γ times per round:
  base_logits float32 [B, Vd], hidden float32 [B, d], prev int64 [B] (draft index of
  x_{k−1}; Vd = outside the draft vocabulary)[, state float32 [B, r] for the RNN head]
  → logits float32 [B, Vd] (z_k), confidence float32 [B] (raw logit c_k)[, state_out]
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from dspark.export import export_graph
from dspark.models.block_drafter import BlockDrafter


def _kv_names(prefix_k: str, prefix_v: str, layers: int) -> list[str]:
    return [n for i in range(layers) for n in (f"{prefix_k}.{i}", f"{prefix_v}.{i}")]


class ContextGraph(nn.Module):
    def __init__(self, model: BlockDrafter) -> None:
        super().__init__()
        self.model = model

    def forward(self, features, positions):
        kv = self.model.context_kv(self.model.project_context(features), positions)
        return tuple(t for k, v in kv for t in (k, v))


class BackboneGraph(nn.Module):
    def __init__(self, model: BlockDrafter, new_positions: int) -> None:
        super().__init__()
        self.model = model
        self.M = new_positions

    def forward(self, anchor_ids, ctx_len, new_features, new_count, *cache):
        m, M = self.model, self.M
        L = m.cfg.num_layers
        S = cache[0].shape[2]
        new_pos = ctx_len.unsqueeze(1) + torch.arange(M).unsqueeze(0)
        new_kv = m.context_kv(m.project_context(new_features), new_pos)
        ctx_ok = torch.arange(S).unsqueeze(0) < ctx_len.unsqueeze(1)
        new_ok = torch.arange(M).unsqueeze(0) < new_count.unsqueeze(1)
        ctx_kv = [(cache[2 * i], cache[2 * i + 1]) for i in range(L)]
        extra = [(k, v, new_ok) for k, v in new_kv]
        U, h = m.backbone(anchor_ids, ctx_len + new_count, ctx_kv, ctx_ok, extra)
        return (U, h, *[t for k, v in new_kv for t in (k, v)])


class HeadGraph(nn.Module):
    def __init__(self, model: BlockDrafter) -> None:
        super().__init__()
        self.model = model

    def forward(self, base_logits, hidden, prev, *state):
        z, c, s = self.model.head_step(base_logits, hidden, prev, state[0] if state else None)
        return (z, c, s) if state else (z, c)


def graph_names(model: BlockDrafter) -> dict[str, tuple[list[str], list[str]]]:
    L = model.cfg.num_layers
    rnn = model.cfg.head == "rnn"
    return {
        "drafter_context": (["features", "positions"], _kv_names("ctx_key", "ctx_value", L)),
        "drafter_backbone": (
            ["anchor_ids", "ctx_len", "new_features", "new_count", *_kv_names("ctx_key", "ctx_value", L)],
            ["base_logits", "hidden", *_kv_names("new_ctx_key", "new_ctx_value", L)],
        ),
        "drafter_head": (
            ["base_logits", "hidden", "prev"] + (["state"] if rnn else []),
            ["logits", "confidence"] + (["state_out"] if rnn else []),
        ),
    }


def _f32(model: BlockDrafter) -> BlockDrafter:
    m = copy.deepcopy(model).float().eval()
    m.embed = model.embed.float()
    m.lm_head = model.lm_head.float()
    return m


def export_context(model: BlockDrafter, path: Path) -> Path:
    m = _f32(model)
    ins, outs = graph_names(m)["drafter_context"]
    g = torch.Generator().manual_seed(0)
    ex = (torch.randn(1, 5, m.cfg.feature_size, generator=g), torch.arange(5).unsqueeze(0))
    axes = {"features": {0: "R", 1: "T"}, "positions": {0: "R", 1: "T"}}
    axes.update({n: {0: "R", 2: "T"} for n in outs})
    return _export(ContextGraph(m), ex, path, ins, outs, axes)


def backbone_example(model: BlockDrafter, batch: int, max_context: int, new_positions: int, seed: int = 0):
    c = model.cfg
    dtype = next(model.parameters()).dtype
    g = torch.Generator().manual_seed(seed)
    V = model.embed.shape[0]
    ctx_len = torch.randint(0, max_context + 1, (batch,), generator=g)
    new_count = torch.randint(0, new_positions + 1, (batch,), generator=g)
    cache = [
        torch.randn(batch, c.num_kv_heads, max_context, c.head_dim, generator=g, dtype=dtype)
        for _ in range(2 * c.num_layers)
    ]
    feats = torch.randn(batch, new_positions, c.feature_size, generator=g, dtype=dtype)
    return (torch.randint(0, V, (batch,), generator=g), ctx_len, feats, new_count, *cache)


def export_backbone(
    model: BlockDrafter, path: Path, batch: int, max_context: int, new_positions: int
) -> Path:
    m = _f32(model)
    ins, outs = graph_names(m)["drafter_backbone"]
    ex = backbone_example(m, batch, min(max_context, 64), new_positions)
    axes = {n: {2: "S"} for n in ins if n.startswith(("ctx_key", "ctx_value"))}  # padded to a bucket
    return _export(BackboneGraph(m, new_positions), ex, path, ins, outs, axes)


def context_buckets(max_context: int, smallest: int = 256) -> list[int]:
    """Cached-context lengths the runner pads to: 256, 512, … up to max_context."""
    out, s = [], smallest
    while s < max_context:
        out.append(s)
        s *= 2
    return out + [max_context]


def head_example(model: BlockDrafter, batch: int, seed: int = 0):
    c = model.cfg
    dtype = next(model.parameters()).dtype
    g = torch.Generator().manual_seed(seed)
    ex = (
        torch.randn(batch, c.draft_vocab_size, generator=g, dtype=dtype),
        torch.randn(batch, c.hidden_size, generator=g, dtype=dtype),
        torch.randint(0, c.draft_vocab_size + 1, (batch,), generator=g),
    )
    if c.head == "rnn":
        ex = ex + (torch.randn(batch, c.markov_rank, generator=g, dtype=dtype),)
    return ex


def export_head(model: BlockDrafter, path: Path, batch: int) -> Path:
    if model.cfg.head == "none":
        raise ValueError(
            "a DFlash drafter (head none) has no sequential head graph: use base_logits directly"
        )
    m = _f32(model)
    ins, outs = graph_names(m)["drafter_head"]
    return _export(HeadGraph(m), head_example(m, batch), path, ins, outs, None)


def _export(module, example, path, ins, outs, axes) -> Path:
    return export_graph(module, example, path, ins, outs, axes)
