"""DSpark's block drafter (and its DFlash baseline): one model family with switches.

Parallel stage — a DFlash-style backbone (reference notes §1.1–1.3). The target's tapped
features of every committed position, f_t = [H^(l1)_t; …; H^(l5)_t], are projected and
normalised, c_t = RMSNorm(W_c f_t) (eq. 2), and injected as extra keys/values in every draft
layer (eq. 3). The block is [x_0 (anchor), MASK × (γ−1)] at positions p0..p0+γ−1; its queries
see the context keys at positions < p0 and all keys of their own block (non-causal). Slot k
(0-based) predicts the token at p0+k+1, so γ inputs give γ drafts. Outputs: base logits U_k
over the draft vocabulary and hidden states h_k.

Sequential stage (eq. 4–6): z_k = U_k + B_k, where B_k depends on the previous token x_{k−1}
(x_0 = the anchor for slot 0): Markov, B = W2·W1[x_{k−1}] (eq. 5); or RNN, a gated state over
[s_{k−1}; W1[x_{k−1}]; h_k] (eq. 6). Confidence (eq. 7): c_k = σ(w·[h_k; W1[x_{k−1}]] + b),
pre-token for slot k. DFlash = the backbone alone (head "none", no confidence).

Draft vocabulary: the drafter predicts over a frequency-ranked subset of the target vocabulary
(`draft_vocab`, target ids); q is zero outside it, which keeps verification lossless (the
residual max(0, p − q) restores the target's mass there). W1 has one extra row for previous
tokens outside the subset (an anchor may be any target token).

The frozen parts (the target's embedding and the LM-head rows of the subset) are not saved
with the drafter: they are taken from the target when the drafter is attached to it.

Upstream checkpoints (dspark.models.importers: DeepSpec DSpark / DFlash, z-lab DFlash) map onto
the same class through config flags whose defaults are our own drafters: `qk_norm` (Qwen3
draft layers: per-head RMSNorm on queries and on block and context keys alike),
`attention_bias` / `attention_out_bias`, `confidence_with_markov` (DeepSpec's confidence head
may read h_k alone) and `feature_layers` (the target taps the drafter was trained on). Their
MASK vector is the target's embedding row of the upstream mask token, and their draft
vocabulary is the whole target vocabulary.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

from dspark.core.interfaces import Drafter, Proposal
from dspark.core.sampling import sample, uniforms, warp_rows
from dspark.models.checkpoint import DraftModelMixin
from dspark.models.losses import block_loss
from dspark.models.slots import SlotPool
from dspark.models.target import (
    MASK_VALUE,
    MLP,
    RMSNorm,
    TargetConfig,
    add_attention_projections,
    apply_rope,
    heads,
    rope_cos_sin,
)


@dataclass(frozen=True)
class DrafterConfig:
    kind: str  # "dspark" | "dflash"
    draft_vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    feature_size: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    block_size: int = 7
    num_layers: int = 2
    head: str = "markov"  # "markov" | "rnn" | "none"
    markov_rank: int = 256
    confidence: bool = True
    confidence_with_markov: bool = True  # confidence input [h_k; W1[x_{k-1}]] (False: h_k alone)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3-style draft layers)
    attention_bias: bool = False  # q/k/v biases
    attention_out_bias: bool = False  # o_proj bias
    feature_layers: tuple[int, ...] | None = None  # target taps it was trained on (None: the target's)
    rope_scaling: tuple[float, ...] | None = None  # Llama-3.1 RoPE (see dspark.models.target)
    # z-lab DFlash: the block is [anchor, MASK × γ] and each MASK slot predicts the token at its
    # own position (the anchor slot's output is dropped); ours and DeepSpec's: [anchor, MASK ×
    # (γ−1)] with slot k predicting position p0 + k + 1. γ = block_size drafts either way.
    predict_own_position: bool = False

    def __post_init__(self) -> None:
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", tuple(float(x) for x in self.rope_scaling))
        if self.feature_layers is not None:
            object.__setattr__(self, "feature_layers", tuple(int(i) for i in self.feature_layers))
            if len(self.feature_layers) * self.hidden_size != self.feature_size:
                raise ValueError(
                    f"feature_size {self.feature_size} is not {len(self.feature_layers)} taps × hidden_size "
                    f"{self.hidden_size}"
                )
        if self.head not in ("markov", "rnn", "none"):
            raise ValueError(f"head must be markov, rnn or none, got {self.head!r}")
        if self.confidence and self.head == "none":
            raise ValueError(
                "the confidence head reads the Markov/RNN embedding W1: it needs head markov or rnn"
            )
        if self.block_size < 1 or self.num_layers < 1:
            raise ValueError("block_size and num_layers must be >= 1")

    @classmethod
    def for_target(cls, t: TargetConfig, kind: str, draft_vocab_size: int, **kw) -> DrafterConfig:
        """Copy the target's layer dimensions (reference notes §1.3)."""
        if not t.feature_layers:
            raise ValueError("the target config has no feature_layers: the drafter needs tapped features")
        if kind == "dflash":
            kw.setdefault("head", "none")
            kw.setdefault("confidence", False)
        return cls(
            kind=kind,
            draft_vocab_size=draft_vocab_size,
            **t.layer_dims(),
            **kw,
        )

    def to_dict(self) -> dict:
        return asdict(self)


class DraftLayer(nn.Module):
    """A Llama layer whose block queries attend to injected context keys plus their own block."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        add_attention_projections(self, cfg)
        d = cfg.hidden_size
        self.mlp = MLP(cfg)  # same field names as TargetConfig
        self.input_layernorm = RMSNorm(d, cfg.rms_eps)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_eps)

    def context_kv(self, c: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Keys/values of projected context features c [R, T, d] (eq. 3: K_i = W_K^i c)."""
        k = heads(self, "k", c, self.cfg.num_kv_heads, self.cfg.head_dim)
        v = heads(self, "v", c, self.cfg.num_kv_heads, self.cfg.head_dim)
        return apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, ctx_k, ctx_v, ctx_ok, extra=None):
        """x [B, G, d] block tokens; ctx_k/v [B or 1, KV, S, D]; ctx_ok [B, S] bool (key j < anchor).

        `extra` = (k, v, ok) is a second context segment scored separately (no concatenation of
        the cache): the exported backbone passes the round's new context positions this way."""
        B, G, _ = x.shape
        c = self.cfg
        u = self.input_layernorm(x)
        q = apply_rope(heads(self, "q", u, c.num_heads, c.head_dim), cos, sin)
        k = apply_rope(heads(self, "k", u, c.num_kv_heads, c.head_dim), cos, sin)
        v = heads(self, "v", u, c.num_kv_heads, c.head_dim)
        rep = c.num_heads // c.num_kv_heads
        qg = q.reshape(B, c.num_kv_heads, rep * G, c.head_dim) * (c.head_dim**-0.5)
        segments = [(ctx_k, ctx_v, ctx_ok)] + ([extra] if extra is not None else [])
        scores = [
            (qg @ sk.transpose(-1, -2)).masked_fill(~ok[:, None, None, :], MASK_VALUE)
            for sk, _, ok in segments
        ]
        scores.append(qg @ k.transpose(-1, -2))  # non-causal within the block
        probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
        out, start = 0, 0
        for _, sv, _ in segments:
            S = sv.shape[2]
            out = out + probs[..., start : start + S] @ sv
            start += S
        out = out + probs[..., start:] @ v
        out = out.reshape(B, c.num_heads, G, c.head_dim).transpose(1, 2).reshape(B, G, -1)
        x = x + self.o_proj(out)
        return x + self.mlp(self.post_attention_layernorm(x))


class BlockDrafter(DraftModelMixin, nn.Module):
    config_class = DrafterConfig

    def __init__(self, cfg: DrafterConfig, draft_vocab: torch.Tensor) -> None:
        super().__init__()
        self.cfg = cfg
        d, r, Vd = cfg.hidden_size, cfg.markov_rank, cfg.draft_vocab_size
        if draft_vocab.shape != (Vd,):
            raise ValueError(f"draft_vocab must hold {Vd} target ids, got shape {tuple(draft_vocab.shape)}")
        self.fc = nn.Linear(cfg.feature_size, d, bias=False)  # W_c
        self.hidden_norm = RMSNorm(d, cfg.rms_eps)  # RMSNorm_ctx
        self.mask_embed = nn.Parameter(torch.zeros(d))  # SmolLM2 has no spare token slot: a learned MASK
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(d, cfg.rms_eps)
        if cfg.head != "none":
            self.w1 = nn.Embedding(Vd + 1, r)  # last row: previous token outside the draft vocabulary
            self.w2 = nn.Linear(r, Vd, bias=False)
        if cfg.head == "rnn":
            self.rnn = nn.Linear(2 * r + d, 3 * r)
        if cfg.confidence:
            self.conf = nn.Linear(d + (r if cfg.confidence_with_markov else 0), 1)
        self.register_buffer("draft_vocab", draft_vocab.long().clone(), persistent=True)
        # target id -> draft index (Vd for ids outside the subset); filled by attach()
        self.register_buffer("to_draft", torch.zeros(0, dtype=torch.long), persistent=False)
        self.embed: torch.Tensor | None = None  # frozen target embedding [V, d]
        self.lm_head: torch.Tensor | None = None  # frozen target LM-head rows of the subset [Vd, d]

    # -- setup -------------------------------------------------------------------------------

    def init_weights(self, seed: int = 0) -> BlockDrafter:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name == "mask_embed":
                    p.normal_(0.0, 1.0 / math.sqrt(p.shape[0]), generator=g)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, 0.02, generator=g)
            if self.cfg.head != "none":
                self.w2.weight.zero_()  # the Markov bias starts at zero: z = U
        return self

    def grown(self, draft_vocab: torch.Tensor) -> BlockDrafter:
        """This drafter over a larger draft vocabulary (target ids; must hold every id it has now),
        for continued training on more data (issue 12): every weight is kept, the Markov/RNN
        rows of the ids it had are copied, a new id's previous-token row W1 starts as the
        "outside the vocabulary" row (which is what the drafter saw for it until now) and its
        Markov output row W2 at zero, so that on the old ids the head computes what it did; the
        new ids' base logits come from the target's LM-head rows (`attach` again after this)."""
        old = self.draft_vocab
        new = torch.unique(draft_vocab.long())  # sorted, as build_draft_vocab writes them
        if not torch.isin(old, new).all():
            raise ValueError("the grown vocabulary must keep every token of the drafter's vocabulary")
        Vd = len(old)
        out = BlockDrafter(replace(self.cfg, draft_vocab_size=len(new)), new)
        state = {k: v for k, v in self.state_dict().items() if k != "draft_vocab"}
        if self.cfg.head != "none":
            where = torch.searchsorted(new, old)  # new index of each old id
            w1, w2 = state["w1.weight"], state["w2.weight"]
            g1 = w1[Vd].expand(len(new) + 1, -1).clone()  # the outside row for every new id and itself
            g1[where] = w1[:Vd]
            g2 = w2.new_zeros(len(new), w2.shape[1])
            g2[where] = w2
            state["w1.weight"], state["w2.weight"] = g1, g2
        out.load_state_dict({**state, "draft_vocab": new}, strict=True)
        return out.to(next(self.parameters()).dtype)

    def deepened(self, num_layers: int) -> BlockDrafter:
        """This drafter with more draft layers (issue 12, item 5: capacity), for continued
        training: the new layers go on top, each a copy of the top layer with its two output
        projections (attention o_proj, MLP down_proj) at zero, so that it starts as the identity
        on the residual stream and the deeper drafter computes exactly what this one did
        (`attach` again after this)."""
        n = self.cfg.num_layers
        if num_layers < n:
            raise ValueError(f"a drafter of {n} draft layers cannot be deepened to {num_layers}")
        state = self.state_dict()  # load_state_dict copies: no clones needed
        top = f"layers.{n - 1}."
        block = {k[len(top) :]: v for k, v in state.items() if k.startswith(top)}
        for i in range(n, num_layers):
            for name, v in block.items():
                zero = name.startswith(("o_proj.", "mlp.down_proj."))
                state[f"layers.{i}.{name}"] = torch.zeros_like(v) if zero else v
        return self._with_layers(num_layers, state)

    def truncated(self, num_layers: int) -> BlockDrafter:
        """This drafter with only its bottom `num_layers` draft layers (issue 12, item 5: the
        smaller end of the capacity sweep), for continued training: the top layers are dropped,
        everything else (context projection, final norm, head, confidence) is kept as it is
        (`attach` again after this). It does not compute what this one did; training mends it."""
        n = self.cfg.num_layers
        if not 1 <= num_layers <= n:
            raise ValueError(f"a drafter of {n} draft layers cannot be truncated to {num_layers}")
        drop = tuple(f"layers.{i}." for i in range(num_layers, n))
        kept = {k: v for k, v in self.state_dict().items() if not k.startswith(drop)}
        return self._with_layers(num_layers, kept)

    def _with_layers(self, num_layers: int, state: dict) -> BlockDrafter:
        """A drafter like this one with `num_layers` draft layers, loaded from `state` in this
        drafter's dtype (strict: the state must hold exactly those layers; the copies are exact)."""
        dtype = next(self.parameters()).dtype
        out = BlockDrafter(replace(self.cfg, num_layers=num_layers), self.draft_vocab).to(dtype)
        out.load_state_dict(state, strict=True)
        return out

    # -- parallel stage ----------------------------------------------------------------------

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """c_t = RMSNorm(W_c f_t) (eq. 2); features [..., T, F]."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def context_kv(self, c: torch.Tensor, positions: torch.Tensor):
        """Per-layer context keys/values for projected context c [R, T, d] at positions [R, T]."""
        cos, sin = rope_cos_sin(
            positions, self.cfg.head_dim, self.cfg.rope_theta, c.dtype, self.cfg.rope_scaling
        )
        return [layer.context_kv(c, cos, sin) for layer in self.layers]

    def backbone(self, anchors: torch.Tensor, p0: torch.Tensor, ctx_kv, ctx_ok: torch.Tensor, extra=None):
        """Base logits U [B, γ, Vd] and hidden h [B, γ, d] for blocks [anchor, MASK×(γ−1)].

        anchors, p0: [B] (anchor token ids and positions); ctx_kv: per layer (k, v) with shape
        [B or 1, KV, S, D]; ctx_ok: [B, S] True where a context key may be attended (pos < p0);
        extra: optional per layer (k, v, ok), a second context segment (see DraftLayer.forward).
        """
        own = self.cfg.predict_own_position
        G = self.cfg.block_size + (1 if own else 0)  # block inputs
        B = anchors.shape[0]
        x = self.mask_embed.expand(B, G, -1).clone()
        x[:, 0] = self.embed[anchors]
        pos = p0.unsqueeze(1) + torch.arange(G)
        cos, sin = rope_cos_sin(pos, self.cfg.head_dim, self.cfg.rope_theta, x.dtype, self.cfg.rope_scaling)
        for i, (layer, (k, v)) in enumerate(zip(self.layers, ctx_kv)):
            x = layer(x, cos, sin, k, v, ctx_ok, extra[i] if extra is not None else None)
        h = self.norm(x[:, 1:] if own else x)  # z-lab: the anchor slot's output is not a draft
        return h @ self.lm_head.T, h

    # -- sequential stage --------------------------------------------------------------------

    def head_step(self, U_k: torch.Tensor, h_k: torch.Tensor, prev: torch.Tensor, state: torch.Tensor | None):
        """One sequential step: corrected logits z_k, confidence logit c_k, next RNN state.

        U_k [B, Vd], h_k [B, d], prev [B] previous tokens as draft indices (Vd = outside)."""
        if self.cfg.head == "none":
            return U_k, torch.zeros(U_k.shape[0], dtype=U_k.dtype), state
        e = self.w1(prev)
        if self.cfg.head == "markov":
            z = U_k + self.w2(e)  # eq. 5
        else:  # eq. 6: gate, candidate and output from [s_{k−1}; W1[x_{k−1}]; h_k]
            if state is None:
                state = e.new_zeros(e.shape)
            gate, cand, out = self.rnn(torch.cat([state, e, h_k], dim=-1)).chunk(3, dim=-1)
            z = U_k + self.w2(torch.tanh(out))
            g = torch.sigmoid(gate)
            state = g * state + (1 - g) * torch.tanh(cand)
        if not self.cfg.confidence:
            conf = U_k.new_zeros(len(U_k))
        elif self.cfg.confidence_with_markov:
            conf = self.conf(torch.cat([h_k, e], dim=-1)).squeeze(-1)
        else:
            conf = self.conf(h_k).squeeze(-1)
        return z, conf, state

    def teacher_forced(self, U: torch.Tensor, h: torch.Tensor, prev: torch.Tensor):
        """All slots at once with ground-truth previous tokens prev [B, γ] (draft indices). The
        Markov head has no state, so all slots go through `head_step` in one call (it is written
        for any leading shape: [B·γ] rows); the RNN head steps through the slots."""
        if self.cfg.head == "markov":
            B, G = prev.shape
            z, c, _ = self.head_step(U.reshape(B * G, -1), h.reshape(B * G, -1), prev.reshape(-1), None)
            return z.view(B, G, -1), c.view(B, G)
        zs, cs, state = [], [], None
        for k in range(U.shape[1]):
            z, c, state = self.head_step(U[:, k], h[:, k], prev[:, k], state)
            zs.append(z)
            cs.append(c)
        return torch.stack(zs, 1), torch.stack(cs, 1)

    def loss(self, seq, blocks):
        """Training loss on the blocks of one cached sequence (dspark.models.losses.block_loss)."""
        return block_loss(self, seq, blocks)


class BlockDrafterRunner(Drafter):
    """Runs a BlockDrafter behind the decoding loop's Drafter interface.

    Each request owns a slot of the drafter's context cache: per layer, the keys/values of its
    committed positions' projected target features (never the block's own keys, which are
    recomputed every round), filled by `begin` and — lazily, in one batched call for every
    drafting request — by the `propose` after `advance`.
    """

    def __init__(
        self, model: BlockDrafter, num_slots: int = 16, max_len: int = 2048, lazy: bool = True
    ) -> None:
        if model.embed is None:
            raise ValueError("attach the target's embedding and LM head first: model.attach(...)")
        self.model = model.eval()
        cfg = model.cfg
        self.block_size = cfg.block_size
        self.vocab_size = model.embed.shape[0]
        dtype = model.fc.weight.dtype
        shape = (num_slots, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_layers)]
        self.length = torch.zeros(num_slots, dtype=torch.long)
        self.max_len = max_len
        self.pool = SlotPool(num_slots, max_len, self.length, "drafter context")
        self._slot: dict[int, int] = {}
        self.pending: dict[int, list[torch.Tensor]] = {}  # slot → committed features not yet projected
        self.catchup = (0, 0.0)  # positions projected at propose time, seconds (running totals)
        self.lazy = lazy  # False: project committed features at once (the eager reference)

    @property
    def free_slots(self) -> int:
        return self.pool.free_slots

    @torch.no_grad()
    def _append(self, slots: list[int], features: list[torch.Tensor]) -> None:
        """Project features[i] into the context of slots[i], after what it holds: one batched
        call for all rows (padded to the longest; the projection is per position, so padding
        changes nothing and is not written)."""
        rows = [(s, f) for s, f in zip(slots, features) if len(f)]
        if not rows:
            return
        n = torch.tensor([len(f) for _, f in rows])
        start = torch.stack([self.length[s] for s, _ in rows])
        T = int(n.max())
        batch = torch.zeros(len(rows), T, rows[0][1].shape[-1], dtype=rows[0][1].dtype)
        for r, (_, f) in enumerate(rows):
            batch[r, : len(f)] = f
        c = self.model.project_context(batch)
        kv = self.model.context_kv(c, start.unsqueeze(1) + torch.arange(T).unsqueeze(0))
        for r, (s, _) in enumerate(rows):
            a, b = int(start[r]), int(start[r] + n[r])
            for i, (k, v) in enumerate(kv):
                self.k[i][s, :, a:b] = k[r, :, : b - a]
                self.v[i][s, :, a:b] = v[r, :, : b - a]
            self.length[s] = b

    def _check_room(self, slot: int, extra: int) -> None:
        if int(self.length[slot]) + len(self.pending[slot]) + extra > self.max_len:
            raise ValueError(f"drafter context would exceed {self.max_len} positions: raise max_len")

    def begin(self, rid: int, token_ids: list[int], features: torch.Tensor) -> None:
        slot = self.pool.allocate()
        self._slot[rid] = slot
        self.pending[slot] = []
        try:
            self._check_room(slot, len(features))
            self._append([slot], [features])
        except Exception:
            self.end(rid)
            raise

    def advance(self, rid: int, token_ids: list[int], features: torch.Tensor) -> None:
        """Committed features wait (lazy) until this request next drafts: then every drafting
        request's waiting features are projected in one batched call."""
        slot = self._slot[rid]
        self._check_room(slot, len(features))
        if self.lazy:
            self.pending[slot].append(features)
        else:
            self._append([slot], [features])

    def catchup_positions(self, rid: int) -> int:
        return sum(len(f) for f in self.pending[self._slot[rid]])

    def catchup_totals(self) -> tuple[int, float]:
        return self.catchup

    def end(self, rid: int) -> None:
        slot = self._slot.pop(rid, None)
        if slot is not None:
            self.pending.pop(slot, None)
            self.pool.release(slot)

    @torch.no_grad()
    def propose(self, rids, anchors, params, gens) -> Proposal:
        m = self.model
        slots = [self._slot[r] for r in rids]
        waiting = [(s, torch.cat(self.pending[s])) for s in slots if self.pending[s]]
        t0 = time.perf_counter()
        self._append([s for s, _ in waiting], [f for _, f in waiting])
        if waiting:
            n = sum(len(f) for _, f in waiting)
            self.catchup = (self.catchup[0] + n, self.catchup[1] + time.perf_counter() - t0)
        for s, _ in waiting:
            self.pending[s] = []
        idx = torch.tensor(slots)
        p0 = self.length[idx]
        S = int(p0.max())
        ctx_kv = [(k[idx, :, :S], v[idx, :, :S]) for k, v in zip(self.k, self.v)]
        ctx_ok = torch.arange(S).unsqueeze(0) < p0.unsqueeze(1)
        anchor_ids = torch.tensor(anchors)
        U, h = m.backbone(anchor_ids, p0, ctx_kv, ctx_ok)
        return sample_block(
            m.head_step, U, h, m.to_draft[anchor_ids], m.draft_vocab, self.vocab_size, params, gens
        )


def block_uniforms(gens, G: int) -> torch.Tensor:
    """[R, G] float64: each request's γ uniforms for one draft block, drawn in slot order."""
    return torch.stack([uniforms(g, G) for g in gens])


def sample_block(head_step, U, h, prev, draft_vocab, vocab_size, params, gens, us=None) -> Proposal:
    """The sequential stage of one round, shared by the PyTorch and the engine runners and by
    the `drafter_head` model's block entry (which gets the uniforms `us` instead of `gens`).

    head_step(U_k, h_k, prev, state) -> (z_k, c_k, state) is the Markov/RNN head (PyTorch or
    an engine); U [R, γ, Vd] and h [R, γ, d] come from the backbone; prev [R] are the anchors
    as draft indices. Each request draws its γ uniforms first, in slot order (block_uniforms)."""
    R, G = U.shape[0], U.shape[1]
    if us is None:
        us = block_uniforms(gens, G)
    index = torch.zeros(R, G, dtype=torch.long)
    probs = torch.zeros(R, G, len(draft_vocab))  # q over the draft vocabulary; zero elsewhere
    conf = torch.zeros(R, G)
    state = None
    g_rows = torch.tensor([r for r, p in enumerate(params) if p.greedy], dtype=torch.long)
    others = [r for r, p in enumerate(params) if not p.greedy]
    for k in range(G):
        z, c, state = head_step(U[:, k], h[:, k], prev, state)
        conf[:, k] = c.float()
        probs[:, k] = warp_rows(z, params)
        if len(g_rows):  # a greedy row's q is a one-hot: inverse-CDF sampling returns its 1
            index[g_rows, k] = probs[g_rows, k].argmax(-1)
        for r in others:
            index[r, k] = sample(probs[r, k], us[r, k])
        prev = index[:, k]
    return Proposal(draft_vocab[index], probs, conf, vocab=draft_vocab, index=index)
