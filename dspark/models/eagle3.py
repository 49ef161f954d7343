"""The EAGLE-3 baseline: an autoregressive drafter on fused target features (reference notes §2.5).

Fused features. For a committed position t, g_t = RMSNorm(W_fuse f_t), where f_t = [H^(l1)_t; …;
H^(lm)_t] are the target's tapped layer outputs (the same taps as the block drafter).

Draft sequence. The input at position t is u_t = W_in [E[x_{t+1}]; g_t]: the token after t and
the features of t. One Llama decoder layer (causal self-attention over the draft sequence, its own
KV cache) and a final RMSNorm give the hidden state o_t; the logits o_t · E_lm^T over the draft
vocabulary predict x_{t+2}.

Drafting from an anchor x_s at position s (target features exist for positions ≤ s−1):
  step 1    input [E[x_s]; g_{s−1}] at position s−1                → q_1 predicts x_{s+1}
  step j≥2  input [E[x̂_{s+j−1}]; o_{step j−1}] at position s−2+j  → q_j predicts x_{s+j}
the draft's own hidden output replaces the target features it does not have. So slot k (0-based)
predicts x_{s+k+1}, the block drafter's layout. Step 1's input is fully committed (x_s and
f_{s−1} are known), so its K/V stay in the cache; the K/V of steps j ≥ 2 are temporary.

Training-time test (TTT, γ = block_size steps). One causal pass over the committed sequence gives
every position's K/V with teacher-forced tokens and real features (step 1 of every anchor). The
chain of anchor a then runs steps 2..γ with ground-truth tokens x_{a+j−1} and its own previous
hidden output, at positions a−2+j; its queries attend to the committed positions < a (so up to its
own step 1 at a−1) and to its own earlier steps; chains never see each other. This is exactly the
computation the runtime performs when fed the same tokens.

Loss (per slot k, weight 0.8^k, masked by blocks.valid, normalised by Σ weights): the soft
cross-entropy −Σ_{v ∈ draft vocab} p^t(v) log p^d(v) against the target's distribution. p^t on
the draft vocabulary is exp(h_t·E_v − lse) as in dspark.models.losses.block_loss; the target's mass
outside the draft vocabulary cannot be matched and is dropped, not renormalised (the minimiser
is still p^t renormalised on the subset; a slot whose target mass lies mostly outside simply
weighs less). Reported with it: the analytic acceptance 1 − ½‖p^d − p^t‖_1 over the full vocabulary
(the outside mass included).

Draft vocabulary and frozen parts as in dspark.models.block_drafter: `draft_vocab` holds target ids; the
embedding (full vocabulary: the chain's input tokens may be any target token) and the LM-head rows
of the subset come from the target in `attach` and are never trained or saved. There is no
confidence head: the runner returns zero confidence logits (σ = ½ for every slot), so use it with
confidence-free policies (static:k).

Upstream layout (`layout="upstream"`: DeepSpec's Qwen3Eagle3Model and the vLLM / SGLang
EAGLE-3 checkpoints, imported by dspark.models.importers). The same runner and the same slot
layout, with the upstream arithmetic: g_t = W_fuse f_t with no norm; the layer reads the
2d-wide z = [RMSNorm_in(E[x_{t+1}]); RMSNorm_hidden(g_t)] (q/k/v take 2d inputs), its residual
is g_t itself (not the concatenation), and its output o is not normed: the next step feeds o
as it is and the logits are RMSNorm(o) · E_lm^T. `own_lm_head` keeps the checkpoint's own LM
head over its draft vocabulary (vLLM's d2t layout) instead of the target's rows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from dspark.core.interfaces import Drafter, Proposal
from dspark.core.sampling import sample, uniforms, warp
from dspark.models.checkpoint import DraftModelMixin
from dspark.models.losses import BlockBatch, LossOut, Sequence, l1_distance, target_probs
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

STEP_DECAY = 0.8  # TTT loss weight of 0-based step k: 0.8^k (reference notes §2.5)


@dataclass(frozen=True)
class Eagle3Config:
    kind: str  # "eagle3"
    draft_vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    feature_size: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    block_size: int = 7  # γ = TTT length = tokens verified per round
    num_layers: int = 1
    layout: str = "dspark"  # "dspark" (ours, above) | "upstream" (DeepSpec / vLLM EAGLE-3)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3-style layer)
    attention_bias: bool = False  # q/k/v biases
    attention_out_bias: bool = False  # o_proj bias
    own_lm_head: bool = False  # the checkpoint's own LM head over its draft vocabulary
    feature_layers: tuple[int, ...] | None = None  # target taps it was trained on (None: the target's)
    rope_scaling: tuple[float, ...] | None = None  # Llama-3.1 RoPE (see dspark.models.target)

    def __post_init__(self) -> None:
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", tuple(float(x) for x in self.rope_scaling))
        if self.kind != "eagle3":
            raise ValueError(f"Eagle3Config.kind must be 'eagle3', got {self.kind!r}")
        if self.layout not in ("dspark", "upstream"):
            raise ValueError(f"Eagle3Config.layout must be 'dspark' or 'upstream', got {self.layout!r}")
        if self.layout == "upstream" and self.num_layers != 1:
            raise ValueError("the upstream EAGLE-3 layout has exactly one layer")
        if self.feature_layers is not None:
            object.__setattr__(self, "feature_layers", tuple(int(i) for i in self.feature_layers))
        if self.block_size < 1 or self.num_layers < 1:
            raise ValueError("block_size and num_layers must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}"
            )

    @classmethod
    def for_target(cls, t: TargetConfig, draft_vocab_size: int, **kw) -> Eagle3Config:
        """Copy the target's layer dimensions."""
        if not t.feature_layers:
            raise ValueError("the target config has no feature_layers: the drafter needs tapped features")
        kw.setdefault("kind", "eagle3")
        return cls(
            draft_vocab_size=draft_vocab_size,
            hidden_size=t.hidden_size,
            intermediate_size=t.intermediate_size,
            num_heads=t.num_heads,
            num_kv_heads=t.num_kv_heads,
            head_dim=t.head_dim,
            feature_size=t.feature_size,
            rms_eps=t.rms_eps,
            rope_theta=t.rope_theta,
            **kw,
        )

    def to_dict(self) -> dict:
        return asdict(self)


def step_weights(gamma: int) -> torch.Tensor:
    return STEP_DECAY ** torch.arange(gamma, dtype=torch.float32)


class Eagle3Layer(nn.Module):
    """A Llama layer whose keys are written before its queries attend (a KV cache's order).

    `kv` gives the keys/values of new inputs; the caller stores them (cache, chain list) and
    passes every key segment the queries may see to `forward`, each with its own mask.
    """

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.upstream = cfg.layout == "upstream"
        add_attention_projections(self, cfg, in_features=2 * d if self.upstream else d)
        self.mlp = MLP(cfg)  # same field names as TargetConfig
        self.input_layernorm = RMSNorm(d, cfg.rms_eps)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_eps)
        if self.upstream:
            self.hidden_norm = RMSNorm(d, cfg.rms_eps)

    def attn_input(self, x: torch.Tensor) -> torch.Tensor:
        """What q/k/v read: RMSNorm(x), or upstream [RMSNorm_in(E); RMSNorm_hidden(g)] of x = [E; g]."""
        if not self.upstream:
            return self.input_layernorm(x)
        d = self.cfg.hidden_size
        return torch.cat([self.input_layernorm(x[..., :d]), self.hidden_norm(x[..., d:])], dim=-1)

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., self.cfg.hidden_size :] if self.upstream else x

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Keys/values [B, KV, N, D] of the layer inputs x [B, N, d] ([B, N, 2d] upstream)."""
        c = self.cfg
        u = self.attn_input(x)
        k = heads(self, "k", u, c.num_kv_heads, c.head_dim)
        v = heads(self, "v", u, c.num_kv_heads, c.head_dim)
        return apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, keys):
        """x [B, N, d]; keys: segments (k, v, ok) with k/v [B or 1, KV, S, D] and ok
        [B or 1, N or 1, S] bool (True = may attend) or None (all keys visible)."""
        B, N, _ = x.shape
        c = self.cfg
        rep = c.num_heads // c.num_kv_heads
        u = self.attn_input(x)
        q = apply_rope(heads(self, "q", u, c.num_heads, c.head_dim), cos, sin)
        qg = q.reshape(B, c.num_kv_heads, rep * N, c.head_dim) * (c.head_dim**-0.5)
        scores = []
        for k, _, ok in keys:
            s = qg @ k.transpose(-1, -2)  # [B, KV, rep·N, S]
            if ok is not None:
                b, S = ok.shape[0], ok.shape[-1]
                ok = ok.unsqueeze(1).expand(b, rep, N, S).reshape(b, 1, rep * N, S)
                s = s.masked_fill(~ok, MASK_VALUE)
            scores.append(s)
        scores = torch.cat(scores, dim=-1)
        low = scores.dtype in (torch.float16, torch.bfloat16)
        probs = torch.softmax(scores.float() if low else scores, dim=-1).to(q.dtype)
        out, start = 0, 0
        for k, v, _ in keys:
            out = out + probs[..., start : start + k.shape[2]] @ v
            start += k.shape[2]
        out = out.reshape(B, c.num_heads, N, c.head_dim).transpose(1, 2).reshape(B, N, -1)
        x = self.residual(x) + self.o_proj(out)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Drafter(DraftModelMixin, nn.Module):
    config_class = Eagle3Config

    def __init__(self, cfg: Eagle3Config, draft_vocab: torch.Tensor) -> None:
        super().__init__()
        self.cfg = cfg
        d, Vd = cfg.hidden_size, cfg.draft_vocab_size
        if draft_vocab.shape != (Vd,):
            raise ValueError(f"draft_vocab must hold {Vd} target ids, got shape {tuple(draft_vocab.shape)}")
        self.upstream = cfg.layout == "upstream"
        self.fuse = nn.Linear(cfg.feature_size, d, bias=False)  # W_fuse
        if not self.upstream:  # upstream: no norm after W_fuse, no W_in (the layer reads [E; g])
            self.fuse_norm = RMSNorm(d, cfg.rms_eps)
            self.fc = nn.Linear(2 * d, d, bias=False)  # W_in on [E[x_{t+1}]; g_t or o]
        self.layers = nn.ModuleList(Eagle3Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(d, cfg.rms_eps)
        if cfg.own_lm_head:  # kept by attach() instead of the target's rows
            self.lm_head_weight = nn.Parameter(torch.zeros(Vd, d))
        self.register_buffer("draft_vocab", draft_vocab.long().clone(), persistent=True)
        # target id -> draft index (Vd for ids outside the subset); filled by attach()
        self.register_buffer("to_draft", torch.zeros(0, dtype=torch.long), persistent=False)
        self.embed: torch.Tensor | None = None  # frozen target embedding [V, d]
        self.lm_head: torch.Tensor | None = None  # frozen target LM-head rows of the subset [Vd, d]

    # -- setup -------------------------------------------------------------------------------

    def init_weights(self, seed: int = 0) -> Eagle3Drafter:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, 0.02, generator=g)
        return self

    # -- pieces ------------------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """g_t = RMSNorm(W_fuse f_t) (upstream: W_fuse f_t); features [..., F]."""
        g = self.fuse(features.to(self.dtype))
        return g if self.upstream else self.fuse_norm(g)

    def draft_input(self, next_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """u = W_in [E[next_ids]; hidden]: next_ids [...] target ids, hidden [..., d] (g_t or o).
        Upstream: [E[next_ids]; hidden] itself (the layer normalises each half)."""
        u = torch.cat([self.embed[next_ids], hidden], dim=-1)
        return u if self.upstream else self.fc(u)

    def out_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The layer output o that the next step feeds and the logits read: RMSNorm(x) (ours)
        or x itself (upstream, which normalises only in front of the LM head)."""
        return x if self.upstream else self.norm(x)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, dtype, self.cfg.rope_scaling)

    def logits(self, o: torch.Tensor) -> torch.Tensor:
        return (self.norm(o) if self.upstream else o) @ self.lm_head.T

    # -- training-time test ------------------------------------------------------------------

    def committed_pass(self, u: torch.Tensor, rows: torch.Tensor):
        """Causal pass over the committed inputs u [T', d] (position t = index t).

        Returns the per-layer keys/values (k, v) [1, KV, T', D] of every position and the
        normed outputs o [B, d] at positions `rows` [B] only (the last layer's queries are
        restricted to them; earlier layers run over every position for the next layer's K/V).
        """
        T = u.shape[0]
        pos = torch.arange(T).unsqueeze(0)
        cos, sin = self.rope(pos, u.dtype)
        causal = torch.ones(T, T, dtype=torch.bool).tril().unsqueeze(0)
        x, kv = u.unsqueeze(0), []
        for i, layer in enumerate(self.layers):
            k, v = layer.kv(x, cos, sin)
            kv.append((k, v))
            if i < len(self.layers) - 1:
                x = layer(x, cos, sin, [(k, v, causal)])
            else:
                ok = (torch.arange(T).unsqueeze(0) <= rows.unsqueeze(1)).unsqueeze(1)  # [B, 1, T']
                x = layer(
                    x[0, rows].unsqueeze(1),
                    cos[0, rows].unsqueeze(1),
                    sin[0, rows].unsqueeze(1),
                    [(k, v, ok)],
                )
        return kv, self.out_hidden(x[:, 0])

    def chain_step(self, x: torch.Tensor, positions: torch.Tensor, ctx_kv, ctx_ok, chain_kv) -> torch.Tensor:
        """One TTT step j ≥ 2 for B chains: inputs x [B, d] at positions [B].

        Queries see the committed keys where ctx_ok [B, 1, T'] and their own chain's keys;
        chain_kv (per layer: lists of k and v) receives this step's keys. Returns o [B, d]."""
        cos, sin = self.rope(positions.unsqueeze(1), x.dtype)
        x = x.unsqueeze(1)
        for layer, (ck, cv), (ks, vs) in zip(self.layers, ctx_kv, chain_kv):
            k, v = layer.kv(x, cos, sin)
            ks.append(k)
            vs.append(v)
            own = (torch.cat(ks, dim=2), torch.cat(vs, dim=2), None)
            x = layer(x, cos, sin, [(ck, cv, ctx_ok), own])
        return self.out_hidden(x[:, 0])

    def ttt_logits(
        self, features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor, prev: torch.Tensor
    ) -> torch.Tensor:
        """Logits [B, γ, Vd] of every anchor's chain, teacher-forced on tokens.

        features [T', F]: target features of positions 0..T'−1; tokens [≥ T'+1] target ids (the
        committed input at t uses x_{t+1}); anchors [B] positions a, 1 ≤ a ≤ T'; prev [B, γ]:
        the token fed at each step, prev[:, k] = x_{a+k} (prev[:, 0], the anchor, is tokens[a]
        and enters through the committed pass)."""
        T = features.shape[0]
        if int(anchors.min()) < 1 or int(anchors.max()) > T:
            raise ValueError(f"anchors must lie in 1..{T} (features exist for positions < anchor)")
        u = self.draft_input(tokens[1 : T + 1], self.fuse_features(features))
        ctx_kv, o = self.committed_pass(u, anchors - 1)
        ctx_ok = (torch.arange(T).unsqueeze(0) < anchors.unsqueeze(1)).unsqueeze(1)  # positions ≤ a−1
        chain_kv = [([], []) for _ in self.layers]
        zs = [self.logits(o)]
        for k in range(1, self.cfg.block_size):
            x = self.draft_input(prev[:, k], o)
            o = self.chain_step(x, anchors - 1 + k, ctx_kv, ctx_ok, chain_kv)
            zs.append(self.logits(o))
        return torch.stack(zs, dim=1)

    def loss(self, seq: Sequence, blocks: BlockBatch) -> LossOut:
        """TTT soft cross-entropy on the blocks of one cached sequence (module docstring)."""
        cfg = self.cfg
        dtype = self.dtype
        z = self.ttt_logits(seq.features, seq.tokens, blocks.anchors, blocks.prev)
        logp_d = torch.log_softmax(z.float(), dim=-1)  # [B, γ, Vd]
        p_t, outside = target_probs(seq, blocks, self.lm_head, dtype)
        ce = -(p_t * logp_d).sum(-1)  # the outside mass is dropped
        l1 = l1_distance(logp_d.exp(), p_t, outside)
        w = step_weights(cfg.block_size).unsqueeze(0) * blocks.valid
        norm = w.sum().clamp(min=1e-8)
        ce = (ce * w).sum() / norm
        tv = (l1 * w).sum() / norm
        accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0)
        return LossOut(
            ce,
            ce.item(),
            tv.item(),
            0.0,
            (accept.detach() * blocks.valid).sum(0),
            blocks.valid.sum(0).float(),
        )


class Eagle3Runner(Drafter):
    """Runs an Eagle3Drafter behind the decoding loop's Drafter interface.

    Each request owns a slot: its committed tokens, their fused features g_t, and per layer the
    draft KV cache. Entry t of the cache needs x_{t+1}, so it is filled lazily at `propose`:
    `filled[slot]` entries are complete, and a proposal first runs the pending committed
    positions filled..s−1 (the last of them, s−1, takes the anchor x_s: that is step 1, rerun
    if a request proposes twice without advancing). The chain's later steps write temporary
    entries at s, s+1, … that the next proposal overwrites.
    Confidence logits are zeros: EAGLE-3 has no confidence head.
    """

    def __init__(self, model: Eagle3Drafter, num_slots: int = 16, max_len: int = 2048) -> None:
        if model.embed is None:
            raise ValueError("attach the target's embedding and LM head first: model.attach(...)")
        self.model = model.eval()
        cfg = model.cfg
        self.block_size = cfg.block_size
        self.vocab_size = model.embed.shape[0]
        dtype = model.dtype
        # room for the chain's temporary entries after a full context of max_len positions
        shape = (num_slots, cfg.num_kv_heads, max_len + cfg.block_size - 1, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_layers)]
        self.g = torch.zeros(num_slots, max_len, cfg.hidden_size, dtype=dtype)  # fused features
        self.tokens = torch.zeros(num_slots, max_len, dtype=torch.long)
        self.length = torch.zeros(num_slots, dtype=torch.long)  # committed tokens (= features)
        self.filled = torch.zeros(num_slots, dtype=torch.long)  # complete committed cache entries
        self.max_len = max_len
        self.pool = SlotPool(num_slots, max_len, self.length, "drafter context")
        self._slot: dict[int, int] = {}

    @property
    def free_slots(self) -> int:
        return self.pool.free_slots

    @torch.no_grad()
    def _append(self, slot: int, token_ids: list[int], features: torch.Tensor) -> None:
        n, start = len(token_ids), int(self.length[slot])
        if features.shape[0] != n:
            raise ValueError(f"got {n} tokens but features for {features.shape[0]} positions")
        if start + n > self.max_len:
            raise ValueError(f"drafter context would exceed {self.max_len} positions: raise max_len")
        self.tokens[slot, start : start + n] = torch.tensor(token_ids, dtype=torch.long)
        self.g[slot, start : start + n] = self.model.fuse_features(features)
        self.length[slot] = start + n

    def begin(self, rid: int, token_ids: list[int], features: torch.Tensor) -> None:
        slot = self.pool.allocate()
        self._slot[rid] = slot
        self.filled[slot] = 0
        self._append(slot, token_ids, features)

    def advance(self, rid: int, token_ids: list[int], features: torch.Tensor) -> None:
        self._append(self._slot[rid], token_ids, features)

    def end(self, rid: int) -> None:
        slot = self._slot.pop(rid, None)
        if slot is not None:
            self.filled[slot] = 0
            self.pool.release(slot)

    def _forward(self, slots: torch.Tensor, u: torch.Tensor, pos: torch.Tensor, n: torch.Tensor):
        """Feed inputs u [R, N, d] at positions pos [R, N] (the first n[r] valid), writing their
        K/V into the cache; returns the normed output [R, d] of each row's last valid input."""
        m = self.model
        R, N, _ = u.shape
        valid = torch.arange(N).unsqueeze(0) < n.unsqueeze(1)
        rows, cols = valid.nonzero(as_tuple=True)
        last = n - 1
        ar = torch.arange(R)
        S = int(pos[ar, last].max()) + 1
        cos, sin = m.rope(pos, u.dtype)
        ok = torch.arange(S).view(1, 1, S) <= pos.unsqueeze(-1)  # [R, N, S]: causal over the cache
        x = u
        for i, layer in enumerate(m.layers):
            k, v = layer.kv(x, cos, sin)
            self.k[i][slots[rows], :, pos[rows, cols]] = k[rows, :, cols]
            self.v[i][slots[rows], :, pos[rows, cols]] = v[rows, :, cols]
            if i == len(m.layers) - 1:  # only the last input's output is needed
                x, cos, sin, ok = (t[ar, last].unsqueeze(1) for t in (x, cos, sin, ok))
            x = layer(x, cos, sin, [(self.k[i][slots, :, :S], self.v[i][slots, :, :S], ok)])
        return m.out_hidden(x[:, 0])

    @torch.no_grad()
    def propose(self, rids, anchors, params, gens) -> Proposal:
        m, G = self.model, self.block_size
        R = len(rids)
        us = torch.stack([uniforms(g, G) for g in gens])
        slots = torch.tensor([self._slot[r] for r in rids])
        s = self.length[slots]  # anchor positions
        # pending committed positions start..s−1; s−1 always, as its entry depends on the anchor
        start = torch.minimum(self.filled[slots], s - 1)
        n = s - start
        pos = start.unsqueeze(1) + torch.arange(int(n.max()))
        idx = pos.clamp(max=self.max_len - 1)
        nxt = self.tokens[slots.unsqueeze(1), (idx + 1).clamp(max=self.max_len - 1)]
        nxt[torch.arange(R), n - 1] = torch.tensor(anchors)  # x_{t+1} of t = s−1 is the anchor
        o = self._forward(slots, m.draft_input(nxt, self.g[slots.unsqueeze(1), idx]), pos, n)  # step 1
        self.filled[slots] = s
        tokens = torch.zeros(R, G, dtype=torch.long)
        probs = torch.zeros(R, G, self.vocab_size)
        ones = torch.ones(R, dtype=torch.long)
        for k in range(G):
            if k > 0:  # step k+1: the previous draft token and the previous hidden output
                u = m.draft_input(tokens[:, k - 1], o).unsqueeze(1)
                o = self._forward(slots, u, (s - 1 + k).unsqueeze(1), ones)
            z = m.logits(o)
            for r in range(R):
                q = warp(z[r], params[r])  # over the draft vocabulary; zero elsewhere
                probs[r, k, m.draft_vocab] = q
                tokens[r, k] = m.draft_vocab[sample(q, us[r, k])]
        return Proposal(tokens, probs, torch.zeros(R, G))
