"""The target's step graph: prefill and verification are the same graph.

One call appends N new tokens per row after `past_len[r]` cached positions and returns what
the decoding loop needs: logits of every new position (verification reads all of them),
the tapped-layer features the drafter consumes, the final hidden state, and the keys/values
of the new positions only. The KV cache itself lives with the caller (the Triton `target`
model keeps it in preallocated slots): the graph takes the cached keys/values as inputs and
never returns the whole cache, so a step copies out only what is new.

Inputs                                       Outputs
  input_ids    int64 [R, N]                    logits       float32 [R, N, V]
  positions    int64 [R, N]                    features     float32 [R, N, F]   (F = 5·d taps)
  past_len     int64 [R]                       last_hidden  float32 [R, N, d]
  valid        bool  [R, N] (False = padding)  new_key.{i}  float32 [R, KV, N, D]  i < layers
  past_key.{i} float32 [R, KV, S, D]           new_value.{i} float32 [R, KV, N, D]
  past_value.{i}

R, N and S are dynamic (S may be 0: a prefill). Row r attends to its first past_len[r] cached
positions and causally to its own valid new tokens.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from dspark.export import export_graph
from dspark.models.target import LlamaTarget


def input_names(num_layers: int) -> list[str]:
    kv = [n for i in range(num_layers) for n in (f"past_key.{i}", f"past_value.{i}")]
    return ["input_ids", "positions", "past_len", "valid", *kv]


def output_names(num_layers: int) -> list[str]:
    kv = [n for i in range(num_layers) for n in (f"new_key.{i}", f"new_value.{i}")]
    return ["logits", "features", "last_hidden", *kv]


class TargetStepGraph(nn.Module):
    """LlamaTarget.forward with flat tensor inputs/outputs (what the exporter needs)."""

    def __init__(self, model: LlamaTarget) -> None:
        super().__init__()
        self.model = model
        self.num_layers = model.cfg.num_layers

    def forward(self, input_ids, positions, past_len, valid, *past):
        L = self.num_layers
        out = self.model(
            input_ids, positions, past_len, list(past[0 : 2 * L : 2]), list(past[1 : 2 * L : 2]), valid
        )
        kv = [t for i in range(L) for t in (out.new_k[i], out.new_v[i])]
        return (out.logits, out.features, out.last_hidden, *kv)


def example_inputs(model: LlamaTarget, rows: int = 2, new: int = 3, past: int = 5) -> tuple:
    """Inputs of an ordinary verification step (ragged: the second row has a shorter past)."""
    c = model.cfg
    dtype = next(model.parameters()).dtype
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, c.vocab_size, (rows, new), generator=g)
    past_len = torch.tensor([past] + [max(past - 2, 0)] * (rows - 1))
    positions = past_len.unsqueeze(1) + torch.arange(new).unsqueeze(0)
    valid = torch.ones(rows, new, dtype=torch.bool)
    valid[1:, -1] = False
    kv = [
        torch.randn(rows, c.num_kv_heads, past, c.head_dim, generator=g, dtype=dtype)
        for _ in range(2 * c.num_layers)
    ]
    return (ids, positions, past_len, valid, *kv)


def export_target(model: LlamaTarget, path: Path) -> Path:
    """Write the target step graph to `path` (float32; the model is converted if needed)."""
    model = copy.deepcopy(model).float().eval()
    L = model.cfg.num_layers
    ins, outs = input_names(L), output_names(L)
    axes = {"input_ids": {0: "R", 1: "N"}, "positions": {0: "R", 1: "N"}, "past_len": {0: "R"}}
    axes["valid"] = {0: "R", 1: "N"}
    for n in ins[4:]:
        axes[n] = {0: "R", 2: "S"}
    axes.update({"logits": {0: "R", 1: "N"}, "features": {0: "R", 1: "N"}, "last_hidden": {0: "R", 1: "N"}})
    for n in outs[3:]:
        axes[n] = {0: "R", 2: "N"}
    return export_graph(TargetStepGraph(model), example_inputs(model), path, ins, outs, axes)
