"""The target model: a Llama-family decoder with an explicit, slot-based KV cache.

Our own forward (not transformers') so that the cache has one obvious owner and the same
module exports to ONNX later with the cache as explicit inputs/outputs. Weights load from any
HF Llama, Qwen2 or Qwen3 checkpoint (the default target is SmolLM2-135M-Instruct, see
`dspark.models.loading`); the families differ only in the attention: Qwen2 adds a bias to the
q/k/v projections, Qwen3 normalises every query and key head (RMSNorm over head_dim) before
RoPE. Tests compare the logits with transformers' LlamaForCausalLM, Qwen2ForCausalLM and
Qwen3ForCausalLM.

Besides logits, every forward returns the drafter's context features: the raw outputs of
`feature_layers` decoder layers (never the last one, whose HF hidden state is normed),
concatenated in list order, f_t = [H^(l1)_t; …; H^(lm)_t] (reference notes §1.1), and the
final normed hidden state (the LM-head input). Tap -1 is the embedding output (DeepSpec's
convention: its layer id i is HF hidden_states[i + 1], so -1 is hidden_states[0]).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from dspark.core.interfaces import TargetStep
from dspark.models.slots import KVSlots, SlotRunner

MASK_VALUE = -1e9  # finite, so a fully padded query row never produces NaN

FAMILIES = ("llama", "qwen2", "qwen3")  # HF model_type values our forward implements


@dataclass(frozen=True)
class TargetConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    feature_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    family: str = "llama"  # HF model_type: llama | qwen2 | qwen3 (see FAMILIES)
    qk_norm: bool = False  # RMSNorm over head_dim on every query/key head before RoPE (Qwen3)
    attention_bias: bool = False  # bias on q/k/v (Qwen2; Llama/Qwen3 with attention_bias)
    attention_out_bias: bool = False  # bias on o_proj (Llama/Qwen3 with attention_bias)
    rope_scaling: tuple[float, ...] | None = None  # Llama-3.1 RoPE: (factor, low, high, original max pos)

    def __post_init__(self) -> None:
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", tuple(float(x) for x in self.rope_scaling))
        if self.family not in FAMILIES:
            raise ValueError(
                f"target family {self.family!r} is not supported: supported are {list(FAMILIES)}"
            )
        bad = [i for i in self.feature_layers if not -1 <= i < self.num_layers - 1]
        if bad:
            raise ValueError(
                f"feature_layers {bad} out of range: taps must be decoder layers 0..{self.num_layers - 2} "
                "or -1 for the embedding output (never the last layer, whose HF hidden state is already "
                "normed)"
            )

    def layer_dims(self) -> dict:
        """The layer dimensions a drafter copies from its target (its layers match the target's)."""
        return dict(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            feature_size=self.feature_size,
            rms_eps=self.rms_eps,
            rope_theta=self.rope_theta,
        )

    @property
    def feature_size(self) -> int:
        return len(self.feature_layers) * self.hidden_size

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TargetConfig:
        d = dict(d)
        d["feature_layers"] = tuple(d.get("feature_layers", ()))
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: object, feature_layers: tuple[int, ...] = ()) -> TargetConfig:
        """From a transformers Llama / Qwen2 / Qwen3 config (or any object with the same
        attributes; only the default RoPE and full attention are supported)."""
        family = getattr(hf, "model_type", None) or "llama"
        if family not in FAMILIES:
            raise ValueError(
                f"model_type {family!r} is not supported: supported target families are "
                f"{', '.join(FAMILIES)} (HF LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)"
            )
        if getattr(hf, "use_sliding_window", False) or "sliding_attention" in (
            getattr(hf, "layer_types", None) or ()
        ):
            raise ValueError(f"{family}: sliding-window attention is not supported (full attention only)")
        if getattr(hf, "mlp_bias", False):
            raise ValueError(f"{family}: MLP biases (mlp_bias) are not supported")
        act = getattr(hf, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{family}: hidden_act {act!r} is not supported (silu only)")
        bias = bool(getattr(hf, "attention_bias", False))
        theta, scaling = parse_rope(
            getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None),
            getattr(hf, "rope_theta", None),
        )
        eos = getattr(hf, "eos_token_id", None)
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        heads = hf.num_attention_heads
        return cls(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=hf.num_key_value_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            rms_eps=hf.rms_norm_eps,
            rope_theta=theta,
            rope_scaling=scaling,
            tie_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
            feature_layers=tuple(feature_layers),
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=eos,
            family=family,
            qk_norm=family == "qwen3",
            attention_bias=bias or family == "qwen2",  # Qwen2: q/k/v always carry a bias
            attention_out_bias=bias and family != "qwen2",
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float() if dtype in (torch.float16, torch.bfloat16) else x
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def parse_rope(rope, theta=None) -> tuple[float, tuple[float, ...] | None]:
    """(θ, scaling) from an HF config's rope_parameters / rope_scaling dict: the default RoPE, or
    Llama-3.1's frequency rescaling ("llama3"); any other type is refused."""
    rope = rope if isinstance(rope, dict) else {}
    rtype = rope.get("rope_type", rope.get("type", "default")) or "default"
    theta = float(rope.get("rope_theta") or theta or 10000.0)
    if rtype == "default":
        return theta, None
    if rtype == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if k not in rope]
        if missing:
            raise ValueError(f"llama3 RoPE parameters lack {missing}")
        return theta, tuple(float(rope[k]) for k in keys)
    raise ValueError(f"rope type {rtype!r} is not supported (default and llama3 RoPE only)")


def rope_inv_freq(head_dim: int, theta: float, scaling: tuple[float, ...] | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] (float64). With Llama-3.1's scaling (factor, low, high,
    original context): wavelengths longer than original/low are slowed down by `factor`, those
    shorter than original/high are kept, and the band between interpolates linearly in
    original/wavelength."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv
    factor, low, high, original = scaling
    wavelen = 2 * math.pi / inv
    smooth = (original / wavelen - low) / (high - low)
    band = (wavelen <= original / low) & (wavelen >= original / high)
    scaled = torch.where(wavelen > original / low, inv / factor, inv)
    return torch.where(band, (1 - smooth) * inv / factor + smooth * inv, scaled)


ROPE_TABLE_POSITIONS = 8192  # positions an exported graph's cos/sin table covers (runners refuse more)


def rope_cos_sin(
    positions: torch.Tensor,
    head_dim: int,
    theta: float,
    dtype: torch.dtype,
    scaling: tuple[float, ...] | None = None,
):
    """cos/sin [R, N, head_dim] for integer positions [R, N] (Llama's half-rotation layout),
    computed in float64 and rounded to `dtype`. In an exported graph they are rows of a table of
    these values for positions 0..ROPE_TABLE_POSITIONS-1 (a `dtype` constant), gathered by
    position: the same numbers, and no float64 op in the graph (TensorRT has no FP64)."""
    table = torch.onnx.is_in_onnx_export()
    pos = torch.arange(ROPE_TABLE_POSITIONS).unsqueeze(0) if table else positions
    inv = rope_inv_freq(head_dim, theta, scaling)
    ang = pos.double().unsqueeze(-1) * inv  # [R, N, D/2]
    ang = torch.cat([ang, ang], dim=-1)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    return (cos[0][positions], sin[0][positions]) if table else (cos, sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [R, H, N, D]; cos/sin [R, N, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def add_attention_projections(module: nn.Module, cfg, in_features: int | None = None) -> None:
    """q/k/v/o projections of a GQA attention (HF names), on any layer config with
    hidden_size, num_heads, num_kv_heads and head_dim (target and drafter layers alike).

    Optional config flags (absent = False, Llama): attention_bias (q/k/v bias),
    attention_out_bias (o bias), qk_norm (per-head q_norm / k_norm, Qwen3). `in_features`
    overrides the projections' input width (EAGLE-3's upstream layer reads 2·hidden)."""
    d, h, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    din = in_features or d
    bias = bool(getattr(cfg, "attention_bias", False))
    module.q_proj = nn.Linear(din, h * hd, bias=bias)
    module.k_proj = nn.Linear(din, kv * hd, bias=bias)
    module.v_proj = nn.Linear(din, kv * hd, bias=bias)
    module.o_proj = nn.Linear(h * hd, d, bias=bool(getattr(cfg, "attention_out_bias", False)))
    if getattr(cfg, "qk_norm", False):
        module.q_norm = RMSNorm(hd, cfg.rms_eps)
        module.k_norm = RMSNorm(hd, cfg.rms_eps)


def heads(module: nn.Module, which: str, x: torch.Tensor, n: int, head_dim: int) -> torch.Tensor:
    """Project x [B, N, ·] with module.{which}_proj into n heads [B, n, N, D]; queries and keys
    go through the per-head norm first when the layer has one (Qwen3's q_norm / k_norm)."""
    B, N = x.shape[0], x.shape[1]
    y = getattr(module, f"{which}_proj")(x).view(B, N, n, head_dim)
    norm = getattr(module, f"{which}_norm", None) if which in ("q", "k") else None
    if norm is not None:
        y = norm(y)
    return y.transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        add_attention_projections(self, cfg)

    def forward(self, x, cos, sin, past_k, past_v, mask):
        """x [R, N, d]; past_k/v [R, KV, S, D]; mask [R, 1, N, S+N] bool (True = may attend)."""
        R, N, _ = x.shape
        c = self.cfg
        q = heads(self, "q", x, c.num_heads, c.head_dim)
        k = heads(self, "k", x, c.num_kv_heads, c.head_dim)
        v = heads(self, "v", x, c.num_kv_heads, c.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # GQA without copying K/V: group the query heads of each KV head ([R, KV, rep·N, D]),
        # and score the cached and the new keys separately instead of concatenating them.
        rep = c.num_heads // c.num_kv_heads
        qg = q.reshape(R, c.num_kv_heads, rep * N, c.head_dim) * (c.head_dim**-0.5)
        scores = torch.cat([qg @ past_k.transpose(-1, -2), qg @ k.transpose(-1, -2)], dim=-1)
        S = past_k.shape[2]
        mask = mask.unsqueeze(2).expand(R, 1, rep, N, S + N).reshape(R, 1, rep * N, S + N)
        scores = scores.masked_fill(~mask, MASK_VALUE)
        low = scores.dtype in (torch.float16, torch.bfloat16)
        probs = torch.softmax(scores.float() if low else scores, dim=-1).to(q.dtype)
        out = probs[..., :S] @ past_v + probs[..., S:] @ v  # [R, KV, rep·N, D]
        out = (
            out.reshape(R, c.num_heads, N, c.head_dim).transpose(1, 2).reshape(R, N, c.num_heads * c.head_dim)
        )
        return self.o_proj(out), k, v


class MLP(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)

    def forward(self, x, cos, sin, past_k, past_v, mask):
        a, k, v = self.self_attn(self.input_layernorm(x), cos, sin, past_k, past_v, mask)
        x = x + a
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k, v


class _Backbone(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)


@dataclass
class ForwardOut:
    logits: torch.Tensor  # [R, N, V]
    features: torch.Tensor  # [R, N, m·d] raw outputs of the tapped layers
    last_hidden: torch.Tensor  # [R, N, d] final normed hidden (LM-head input)
    new_k: list[torch.Tensor] = field(default_factory=list)  # per layer [R, KV, N, D]
    new_v: list[torch.Tensor] = field(default_factory=list)


class LlamaTarget(nn.Module):
    """Llama / Qwen2 / Qwen3 decoder whose forward takes the past KV explicitly (parameter
    names match HF)."""

    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = _Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def random(cls, cfg: TargetConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> LlamaTarget:
        """A randomly initialised model, for fast unit tests only."""
        g = torch.Generator().manual_seed(seed)
        m = cls(cfg)
        with torch.no_grad():
            for name, p in m.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
                elif name.endswith(".bias"):
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * (1.0 / p.shape[-1] ** 0.5))
        return m.to(dtype).eval()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        past_len: torch.Tensor,
        past_k: list[torch.Tensor],
        past_v: list[torch.Tensor],
        valid: torch.Tensor | None = None,
        logits_at: torch.Tensor | None = None,
    ) -> ForwardOut:
        """One forward over N new tokens per row, after `past_len[r]` cached tokens.

        input_ids, positions: [R, N]; past_k/past_v: per layer [R, KV, S, D] (only the first
        past_len[r] entries of row r are attended); valid: [R, N] bool, False for padding;
        logits_at: [R] one position per row: logits only there ([R, 1, V]), not at every position.
        """
        R, N = input_ids.shape
        S = past_k[0].shape[2] if past_k else 0
        if valid is None:
            valid = torch.ones(R, N, dtype=torch.bool)
        past_ok = torch.arange(S).view(1, 1, S) < past_len.view(R, 1, 1)  # [R, 1, S]
        causal = torch.ones(N, N, dtype=torch.bool).tril().unsqueeze(0) & valid.unsqueeze(1)
        mask = torch.cat([past_ok.expand(R, N, S), causal], dim=2).unsqueeze(1)
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(
            positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype, self.cfg.rope_scaling
        )
        want = self.cfg.feature_layers
        taps, new_k, new_v = {-1: x} if -1 in want else {}, [], []
        for i, layer in enumerate(self.model.layers):
            x, k, v = layer(x, cos, sin, past_k[i], past_v[i], mask)
            new_k.append(k)
            new_v.append(v)
            if i in want:
                taps[i] = x
        last = self.model.norm(x)
        feats = torch.cat([taps[i] for i in want], dim=-1) if want else x.new_zeros(R, N, 0)
        at = last if logits_at is None else last[torch.arange(R), logits_at].unsqueeze(1)
        return ForwardOut(self.lm_head(at), feats, last, new_k, new_v)


class TargetRunner(SlotRunner):
    """Runs a LlamaTarget over ragged batches of sequences that own KV slots.

    `step(slots, tokens)` appends tokens[r] to the sequence in slots[r] and returns logits for
    every new position: prefill (the whole prompt) and verification ([x_0, x_1..x_ℓ]) are the
    same call. `rollback` discards rejected positions.
    """

    def __init__(self, model: LlamaTarget, num_slots: int = 16, max_len: int = 2048) -> None:
        self.model = model.eval()
        self.cfg = model.cfg
        dtype = next(model.parameters()).dtype
        self.cache = KVSlots(model.cfg, num_slots, max_len, dtype)

    @torch.no_grad()
    def step(self, slots: list[int], tokens: list[list[int]], last_only: bool = False) -> TargetStep:
        c = self.cache
        n = torch.tensor([len(t) for t in tokens])
        if (n == 0).any():
            raise ValueError("every sequence in a target step needs at least one new token")
        slot_idx = torch.tensor(slots)
        past_len = c.length[slot_idx].clone()
        if int((past_len + n).max()) > c.max_len:
            raise ValueError(
                f"sequence would exceed the KV cache length {c.max_len}: shorten the prompt or max_tokens"
            )
        R, N = len(slots), int(n.max())
        ids = torch.zeros(R, N, dtype=torch.long)
        for r, t in enumerate(tokens):
            ids[r, : len(t)] = torch.tensor(t)
        valid = torch.arange(N).unsqueeze(0) < n.unsqueeze(1)
        positions = past_len.unsqueeze(1) + torch.arange(N).unsqueeze(0)
        S = int(past_len.max())
        first = slots[0]
        if slots == list(range(first, first + R)):  # contiguous slots: views, no copy
            past_k = [k[first : first + R, :, :S] for k in c.k]
            past_v = [v[first : first + R, :, :S] for v in c.v]
        else:
            past_k = [k[slot_idx, :, :S] for k in c.k]
            past_v = [v[slot_idx, :, :S] for v in c.v]
        out = self.model(
            ids, positions, past_len, past_k, past_v, valid, logits_at=n - 1 if last_only else None
        )
        rows, cols = valid.nonzero(as_tuple=True)
        dest_slot, dest_pos = slot_idx[rows], positions[rows, cols]
        for layer in range(self.cfg.num_layers):
            c.k[layer][dest_slot, :, dest_pos] = out.new_k[layer][rows, :, cols]
            c.v[layer][dest_slot, :, dest_pos] = out.new_v[layer][rows, :, cols]
        c.length[slot_idx] = past_len + n
        return TargetStep(out.logits, out.features, out.last_hidden)
