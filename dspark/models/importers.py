"""Importing the drafters the ecosystem publishes into our checkpoint format (`dspark import`).

Supported upstream layouts (a directory with config.json and *.safetensors):

  deepspec  DeepSpec's `Qwen3DSparkModel` — DSpark (vanilla Markov head, optional confidence
            head with or without Markov features) and DFlash (markov_rank 0) — and its
            `Qwen3Eagle3Model`. Keys are bare module paths (no `model.` prefix).
  z-lab     z-lab's DFlash drafters (`DFlashDraftModel`): the DSpark backbone without heads,
            mask token and layer ids under a nested `dflash_config`; no embedding / LM head
            in the file (they are the target's). Its block of `block_size` inputs is [anchor,
            MASK…] whose MASK slots predict their own positions (block_size − 1 drafts), where
            DeepSpec's slot k predicts position p0 + k + 1 (block_size drafts): the
            `predict_own_position` flag of BlockDrafter.
  vllm      the vLLM / SGLang EAGLE-3 layout (`LlamaForCausalLMEagle3`): `midlayer.*`, its own
            LM head over a draft vocabulary mapped to target ids by `d2t`.

DSpark / DFlash map onto `BlockDrafter`: the context projection `fc` + `hidden_norm`, the
draft layers (Qwen3 per-head q/k norms when present), the final norm, the Markov head
(markov_w1 → W1 with one extra zero row for "outside the draft vocabulary", which never
occurs: the draft vocabulary is the whole target vocabulary, as upstream), the confidence
head. The MASK vector is the target's embedding row `mask_token_id`. EAGLE-3 maps onto
`Eagle3Drafter` with `layout="upstream"`. The upstream embedding and LM head, when the file
holds them, must equal the target's (DeepSpec copies and freezes them): we take them from the
target, as for our own drafters. Every tensor is checked by name and shape before anything is
converted; a missing, mis-shaped or unknown tensor and an unsupported head type are refused
with the name of what is wrong. The converted drafter keeps its upstream dtype (fp32 stays
fp32, bf16 stays bf16), so it reproduces the upstream numbers exactly.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SOURCES = ("deepspec", "z-lab", "vllm")
KINDS = ("dspark", "dflash", "eagle3")
ARCHITECTURES = {
    "Qwen3DSparkModel": "DeepSpec DSpark / DFlash",
    "DFlashDraftModel": "z-lab DFlash",
    "Qwen3Eagle3Model": "DeepSpec EAGLE-3",
    "LlamaForCausalLMEagle3": "vLLM / SGLang EAGLE-3",
}
MARKOV_HEADS = ("vanilla",)  # DeepSpec also defines "gated" and "rnn": refused (see docs/decisions.md)
IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$|^t2d$")  # derived buffers, never needed
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


class CheckpointError(ValueError):
    """An upstream checkpoint this importer cannot convert; the message says exactly why."""


@dataclass
class Upstream:
    """What `inspect` found in an upstream drafter directory (printed by `--check`)."""

    path: Path
    config: dict
    shapes: dict[str, tuple[int, ...]]  # normalised key -> shape (read from the headers only)
    dtype: torch.dtype
    source: str  # deepspec | z-lab | vllm
    kind: str  # dspark | dflash | eagle3
    architecture: str
    layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int | None
    vocab_size: int
    draft_vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    rope_scaling: tuple[float, ...] | None
    qk_norm: bool
    attention_bias: bool
    attention_out_bias: bool
    markov: str | None  # head type, None without a Markov head
    markov_rank: int
    confidence: bool
    confidence_with_markov: bool
    num_target_layers: int | None
    notes: list[str] = field(default_factory=list)
    _keymap: dict[str, str] = field(default_factory=dict, repr=False)  # normalised -> file key

    def summary(self) -> str:
        ids = list(self.layer_ids)
        lines = [
            f"drafter      {self.path}",
            f"architecture {self.architecture} ({ARCHITECTURES.get(self.architecture, 'from its keys')})",
            f"layout       {self.source} → our {self.kind} drafter"
            + (" (EAGLE-3 upstream layout)" if self.kind == "eagle3" else ""),
            f"target taps  layer ids {ids} (decoder-layer outputs; HF hidden_states {[i + 1 for i in ids]})"
            + (f", target depth {self.num_target_layers}" if self.num_target_layers else ""),
            f"vocabulary   {self.vocab_size} target ids; drafts over "
            + (
                f"all {self.draft_vocab_size}"
                if self.draft_vocab_size == self.vocab_size
                else f"{self.draft_vocab_size} (d2t map)"
            ),
            f"block        {self.block_size} draft tokens per round"
            + (f", mask token id {self.mask_token_id}" if self.mask_token_id is not None else ""),
            f"layers       {self.num_layers} draft layer(s): hidden {self.hidden_size}, "
            f"MLP {self.intermediate_size}, "
            f"heads {self.num_heads}/{self.num_kv_heads} kv × {self.head_dim}, eps {self.rms_eps:g}, "
            f"rope θ {self.rope_theta:g}{' llama3-scaled' if self.rope_scaling else ''}, "
            f"qk-norm {'yes' if self.qk_norm else 'no'}, "
            f"bias {'q/k/v' if self.attention_bias else 'none'}{' + o' if self.attention_out_bias else ''}",
            "heads        "
            + (f"Markov {self.markov} rank {self.markov_rank}" if self.markov else "no Markov head")
            + "; "
            + (
                f"confidence head on [h; W1[prev]] ({self.hidden_size}+{self.markov_rank})"
                if self.confidence and self.confidence_with_markov
                else ("confidence head on h" if self.confidence else "no confidence head")
            ),
            f"weights      {len(self.shapes)} tensors, {str(self.dtype).removeprefix('torch.')}; embedding "
            + (
                "in the file (checked against the target)"
                if "embed_tokens.weight" in self.shapes
                else "from the target"
            )
            + ", LM head "
            + (
                "own (draft vocabulary)"
                if self.source == "vllm"
                else (
                    "in the file (checked against the target)"
                    if "lm_head.weight" in self.shapes
                    else "from the target"
                )
            ),
        ]
        return "\n".join(lines + [f"note         {n}" for n in self.notes])


# -- reading ----------------------------------------------------------------------------------


def _normalise(key: str) -> str:
    key = key.replace("_orig_mod.", "")
    return key[len("model.") :] if key.startswith("model.") else key


def _headers(path: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, str], dict[str, str]]:
    """(shapes, dtypes, keymap) of every tensor in the directory's safetensors files."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{path}: no *.safetensors weights (only safetensors checkpoints are supported)"
        )
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    keymap: dict[str, str] = {}
    for f in files:
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                n = _normalise(k)
                if n in shapes:
                    raise CheckpointError(f"{path}: tensor {n} appears twice (as {keymap[n]} and {k})")
                sl = h.get_slice(k)
                shapes[n], dtypes[n], keymap[n] = tuple(sl.get_shape()), sl.get_dtype(), f"{f.name}:{k}"
    return shapes, dtypes, keymap


def _tensors(up: Upstream) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    by_file: dict[str, list[tuple[str, str]]] = {}
    for n, loc in up._keymap.items():
        fname, key = loc.split(":", 1)
        by_file.setdefault(fname, []).append((n, key))
    for fname, keys in by_file.items():
        with safe_open(str(up.path / fname), "pt") as h:
            for n, key in keys:
                out[n] = h.get_tensor(key)
    return out


def _get(cfg: dict, *names, default=KeyError):
    """The first of `names` in config.json, looking into nested dflash_config / eagle_config."""
    for scope in (cfg, cfg.get("dflash_config") or {}, cfg.get("eagle_config") or {}):
        for n in names:
            if n in scope and scope[n] is not None:
                return scope[n]
    if default is KeyError:
        raise CheckpointError(f"config.json has no {' / '.join(names)}")
    return default


def _rope(cfg: dict) -> tuple[float, tuple[float, ...] | None]:
    from dspark.models.target import parse_rope

    try:
        return parse_rope(cfg.get("rope_parameters") or cfg.get("rope_scaling"), cfg.get("rope_theta"))
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def _detect(cfg: dict, keys: set[str], where: Path) -> tuple[str, str, str]:
    """(source, kind, architecture) from architectures[0]; from config keys and tensor names
    only when config.json names no architecture."""
    arch = (cfg.get("architectures") or [""])[0]
    midlayer = "d2t" in keys or any(k.startswith("midlayer.") for k in keys)
    if arch:
        eagle = "Eagle3" in arch or "Eagle" in arch
        dspark, dflash = "DSpark" in arch, "DFlash" in arch
    else:
        eagle = midlayer or "layers.0.hidden_norm.weight" in keys
        dspark = "markov_rank" in cfg
        dflash = "dflash_config" in cfg or ("fc.weight" in keys and "hidden_norm.weight" in keys)
    if eagle:
        if midlayer:
            return "vllm", "eagle3", arch or "LlamaForCausalLMEagle3"
        return "deepspec", "eagle3", arch or "Qwen3Eagle3Model"
    if dspark:
        rank = int(cfg.get("markov_rank") or 0)
        return "deepspec", "dspark" if rank > 0 else "dflash", arch or "Qwen3DSparkModel"
    if dflash:
        return "z-lab", "dflash", arch or "DFlashDraftModel"
    raise CheckpointError(
        f"{where}: architecture {arch or '(none)'!r} is not a drafter this importer knows: supported are "
        + ", ".join(f"{a} ({w})" for a, w in ARCHITECTURES.items())
    )


def zlab_default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 3 - 1
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def inspect(path: Path | str, layer_ids=None, mask_token_id: int | None = None) -> Upstream:
    """Read config.json and the tensor headers of an upstream drafter directory (no weights)."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise CheckpointError(f"{path}: no config.json (expected an upstream drafter directory)")
    cfg = json.loads((path / "config.json").read_text())
    shapes, dtypes, keymap = _headers(path)
    keys = set(shapes)
    source, kind, arch = _detect(cfg, keys, path)
    try:
        if mask_token_id is not None:  # the user's override (a config that names no mask token)
            cfg = {**cfg, "mask_token_id": int(mask_token_id)}  # top-level keys win in _get
        if layer_ids is not None:  # the user's override of the config's target layer ids
            cfg = {
                **cfg,
                "target_layer_ids": [int(i) for i in layer_ids],
                "dflash_config": {},
                "eagle_config": {},
            }
        return _inspect(path, cfg, shapes, dtypes, keymap, source, kind, arch)
    except CheckpointError as e:
        msg = str(e)
        raise CheckpointError(msg if msg.startswith(str(path)) else f"{path}: {msg}") from None


def _inspect(path, cfg, shapes, dtypes, keymap, source, kind, arch) -> Upstream:
    notes = []
    H = int(_get(cfg, "hidden_size"))
    heads = int(_get(cfg, "num_attention_heads"))
    model_type = cfg.get("model_type", "")
    qk_norm = model_type == "qwen3" or any(k.endswith("self_attn.q_norm.weight") for k in shapes)
    bias = bool(cfg.get("attention_bias", False))
    V = int(_get(cfg, "vocab_size"))
    if source == "vllm":
        n_layers = 1
    else:
        found = {int(m.group(1)) for k in shapes if (m := re.match(r"layers\.(\d+)\.", k))}
        n_layers = int(_get(cfg, "num_hidden_layers"))
        if kind == "eagle3":
            n_layers = int(cfg.get("draft_num_hidden_layers", n_layers))
        if found and found != set(range(n_layers)):
            raise CheckpointError(
                f"config.json says {n_layers} draft layer(s) but the weights hold layers {sorted(found)}"
            )
    if kind == "eagle3" and n_layers != 1:
        raise CheckpointError(f"an EAGLE-3 drafter with {n_layers} layers is not supported (exactly 1)")
    ids = _get(cfg, "target_layer_ids", "eagle_aux_hidden_state_layer_ids", default=None)
    ntl = cfg.get("num_target_layers")
    if ids is None and source == "z-lab" and ntl:
        # z-lab's rule when the config names none: one tap per draft layer, the middle layer for
        # a single draft layer, else evenly spaced from layer 1 to L - 3 (rounded)
        ids = zlab_default_layer_ids(int(ntl), n_layers)
        notes.append(f"no target_layer_ids in config.json: z-lab's default for {ntl} target layers")
    if ids is None:
        raise CheckpointError(
            "config.json has no target_layer_ids (dflash_config.target_layer_ids, "
            "eagle_config.eagle_aux_hidden_state_layer_ids): pass --layer-ids"
        )
    ids = tuple(int(i) for i in ids)
    if source == "vllm":
        notes.append(
            "vLLM/SGLang layer ids are read as raw decoder-layer outputs (SGLang's convention); "
            "this layout is mapped from its documentation, not checked against upstream outputs"
        )
    fc = shapes.get("fc.weight")
    if fc is not None and fc[1] != len(ids) * H:
        raise CheckpointError(
            f"tensor fc.weight has shape {fc}, but {len(ids)} target layers × hidden_size {H} = "
            f"{len(ids) * H} inputs"
        )
    markov, rank, confidence, with_markov, mask = None, 0, False, False, None
    if kind in ("dspark", "dflash"):
        mask = int(_get(cfg, "mask_token_id"))
        if not 0 <= mask < V:
            raise CheckpointError(f"mask_token_id {mask} is outside the vocabulary of {V}")
        block = int(_get(cfg, "block_size"))
        if source == "z-lab":  # z-lab's block_size counts the anchor slot, which drafts nothing
            block -= 1
            notes.append(
                f"z-lab block of {block + 1} = anchor + {block} MASK slots, each predicting its own "
                "position: mapped from z-lab's published code, not checked against upstream outputs"
            )
        if block < 1:
            raise CheckpointError(f"block_size gives {block} draft tokens per round")
        rank = int(cfg.get("markov_rank") or 0)
        if rank > 0:
            markov = cfg.get("markov_head_type")
            if markov is None:
                raise CheckpointError("markov_rank > 0 but config.json has no markov_head_type")
            if markov not in MARKOV_HEADS:
                known = "is not supported yet" if markov in ("gated", "rnn") else "is unknown"
                raise CheckpointError(
                    f"markov_head_type {markov!r} {known}: supported Markov heads are {list(MARKOV_HEADS)} "
                    "(DeepSpec's gated and rnn heads are not implemented here)"
                )
        confidence = bool(cfg.get("enable_confidence_head", False)) or "confidence_head.proj.weight" in shapes
        if confidence:
            if rank == 0:
                raise CheckpointError(
                    "a confidence head on a drafter without a Markov head (markov_rank 0) is not "
                    "supported yet"
                )
            with_markov = cfg.get("confidence_head_with_markov")
            proj = shapes.get("confidence_head.proj.weight")
            if with_markov is None:  # not stated: read it from the head's input width
                with_markov = proj is not None and proj[-1] == H + rank
            with_markov = bool(with_markov)
    else:
        block = int(_get(cfg, "ttt_length", "block_size", default=7))
    if source == "vllm":
        if "d2t" not in shapes or "lm_head.weight" not in shapes:
            raise CheckpointError("a vLLM/SGLang EAGLE-3 checkpoint needs d2t and lm_head.weight tensors")
        Vd = int(cfg.get("draft_vocab_size") or shapes["lm_head.weight"][0])
    else:
        Vd = V
    dtype_name = dtypes.get("fc.weight") or next(iter(dtypes.values()))
    if dtype_name not in DTYPES:
        raise CheckpointError(f"weights of dtype {dtype_name} are not supported ({list(DTYPES)})")
    if any(i < -1 or (ntl and i >= int(ntl) - 1) for i in ids):
        raise CheckpointError(
            f"target_layer_ids {list(ids)} out of range: taps are -1 (embeddings) .. num_target_layers - 2"
        )
    if kind == "eagle3" and source == "deepspec":
        notes.append(
            "EAGLE-3 runs in the PyTorch loop only: like our own EAGLE-3 baseline, it has no engines"
        )
    elif kind == "eagle3":
        notes.append("EAGLE-3 runs in the PyTorch loop only (no engines)")
    return Upstream(
        path=path,
        config=cfg,
        shapes=shapes,
        dtype=DTYPES[dtype_name],
        source=source,
        kind=kind,
        architecture=arch,
        layer_ids=ids,
        block_size=block,
        mask_token_id=mask,
        vocab_size=V,
        draft_vocab_size=Vd,
        hidden_size=H,
        intermediate_size=int(_get(cfg, "intermediate_size")),
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=int(_get(cfg, "num_key_value_heads", default=heads)),
        head_dim=int(_get(cfg, "head_dim", default=H // heads)),
        rms_eps=float(_get(cfg, "rms_norm_eps", default=1e-6)),
        rope_theta=_rope(cfg)[0],
        rope_scaling=_rope(cfg)[1],
        qk_norm=qk_norm,
        attention_bias=bias or model_type == "qwen2",
        attention_out_bias=bias and model_type != "qwen2",
        markov=markov,
        markov_rank=rank,
        confidence=confidence,
        confidence_with_markov=with_markov,
        num_target_layers=int(ntl) if ntl else None,
        notes=notes,
        _keymap=keymap,
    )


# -- converting -------------------------------------------------------------------------------


def _our_model(up: Upstream):
    """Our (uninitialised) model for the upstream config, and its draft vocabulary."""
    common: dict[str, Any] = dict(
        hidden_size=up.hidden_size,
        intermediate_size=up.intermediate_size,
        num_heads=up.num_heads,
        num_kv_heads=up.num_kv_heads,
        head_dim=up.head_dim,
        feature_size=len(up.layer_ids) * up.hidden_size,
        rms_eps=up.rms_eps,
        rope_theta=up.rope_theta,
        rope_scaling=up.rope_scaling,
        block_size=up.block_size,
        num_layers=up.num_layers,
        qk_norm=up.qk_norm,
        attention_bias=up.attention_bias,
        attention_out_bias=up.attention_out_bias,
        feature_layers=up.layer_ids,
    )
    vocab = torch.arange(up.draft_vocab_size)
    if up.kind == "eagle3":
        from dspark.models.eagle3 import Eagle3Config, Eagle3Drafter

        ecfg = Eagle3Config(
            kind="eagle3",
            draft_vocab_size=up.draft_vocab_size,
            layout="upstream",
            own_lm_head=up.source == "vllm",
            **common,
        )
        return Eagle3Drafter(ecfg, vocab)
    from dspark.models.block_drafter import BlockDrafter, DrafterConfig

    cfg = DrafterConfig(
        kind=up.kind,
        draft_vocab_size=up.draft_vocab_size,
        head="markov" if up.markov else "none",
        markov_rank=up.markov_rank if up.markov else 0,
        confidence=up.confidence,
        confidence_with_markov=up.confidence_with_markov if up.confidence else True,
        predict_own_position=up.source == "z-lab",
        **common,
    )
    return BlockDrafter(cfg, vocab)


def upstream_name(up: Upstream, ours: str) -> str | None:
    """The upstream tensor an entry of our state dict comes from (None: built by the importer)."""
    if ours in ("draft_vocab", "mask_embed"):
        return None
    if up.kind == "eagle3":
        if ours == "fuse.weight":
            return "fc.weight"
        if ours == "lm_head_weight":
            return "lm_head.weight"
        layer = "midlayer." if up.source == "vllm" else "layers.0."
        m = re.match(r"layers\.0\.(.*)$", ours)
        if m:
            rest = m.group(1)
            if re.match(r"[qkvo]_(proj|norm)\.", rest):
                return f"{layer}self_attn.{rest}"
            return layer + rest
        return ours
    m = re.match(r"layers\.(\d+)\.([qkvo]_(proj|norm)\..*)$", ours)
    if m:
        return f"layers.{m.group(1)}.self_attn.{m.group(2)}"
    return {
        "w1.weight": "markov_head.markov_w1.weight",
        "w2.weight": "markov_head.markov_w2.weight",
        "conf.weight": "confidence_head.proj.weight",
        "conf.bias": "confidence_head.proj.bias",
    }.get(ours, ours)


def _expected_shape(up: Upstream, ours: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if ours == "w1.weight":  # ours has one extra row: previous token outside the draft vocabulary
        return (shape[0] - 1, shape[1])
    return shape


def _check_tensors(up: Upstream, model) -> dict[str, str]:
    """Our key -> upstream key for every tensor; raises on anything missing, mis-shaped or unknown."""
    mapping, problems = {}, []
    for ours, t in model.state_dict().items():
        name = upstream_name(up, ours)
        if name is None:
            continue
        want = _expected_shape(up, ours, tuple(t.shape))
        got = up.shapes.get(name)
        if got is None:
            problems.append(f"missing tensor {name} (expected shape {list(want)})")
        elif tuple(got) != want:
            problems.append(f"tensor {name} has shape {list(got)}, expected {list(want)}")
        mapping[ours] = name
    used = set(mapping.values()) | {"embed_tokens.weight", "lm_head.weight", "d2t"}
    unknown = sorted(k for k in up.shapes if k not in used and not IGNORED.search(k))
    if unknown:
        problems.append(
            f"unexpected tensor(s) {unknown[:6]}{' …' if len(unknown) > 6 else ''}: not part of the "
            f"{up.source} {up.kind} layout this importer knows (a different head type or architecture?)"
        )
    if problems:
        raise CheckpointError(f"{up.path}: " + "; ".join(problems))
    return mapping


def _same(name: str, a: torch.Tensor, b: torch.Tensor, where: Path) -> None:
    """The drafter's frozen copy of a target tensor must be the target's (dtype rounding aside)."""
    if tuple(a.shape) != tuple(b.shape):
        raise CheckpointError(
            f"{where}: {name} has shape {list(a.shape)} but the target's has {list(b.shape)}: "
            "this drafter was made for another target"
        )
    d, scale = 0.0, 1e-6
    for i in range(0, a.shape[0], 8192):  # in row chunks: a 152k × 4k table needs no full fp32 copies
        x, y = a[i : i + 8192].float(), b[i : i + 8192].float()
        d, scale = max(d, float((x - y).abs().max())), max(scale, float(y.abs().max()))
    if d > 1e-2 * scale:
        raise CheckpointError(
            f"{where}: {name} differs from the target's (max |Δ| {d:.3g}): this drafter was trained "
            "against another target (or unfroze its embedding / LM head, which our format shares with "
            "the target)"
        )


def check_target(up: Upstream, tcfg) -> None:
    """Refuse a target that does not fit the drafter (depth, width, vocabulary, taps)."""
    problems = []
    if tcfg.hidden_size != up.hidden_size:
        problems.append(f"hidden size {tcfg.hidden_size} (drafter {up.hidden_size})")
    if tcfg.vocab_size != up.vocab_size:
        problems.append(f"vocabulary {tcfg.vocab_size} (drafter {up.vocab_size})")
    if up.num_target_layers and tcfg.num_layers != up.num_target_layers:
        problems.append(f"{tcfg.num_layers} layers (drafter trained on {up.num_target_layers})")
    bad = [i for i in up.layer_ids if not -1 <= i < tcfg.num_layers - 1]
    if bad:
        problems.append(f"no tap for layer ids {bad} (taps are -1 .. {tcfg.num_layers - 2})")
    if problems:
        raise CheckpointError(f"{up.path}: not a drafter for this target: target has " + "; ".join(problems))


def convert(up: Upstream, embed: torch.Tensor, lm_head: torch.Tensor, target_cfg=None):
    """Our drafter (upstream dtype, attached to the target's embedding and LM head)."""
    if target_cfg is not None:
        check_target(up, target_cfg)
    model = _our_model(up)
    mapping = _check_tensors(up, model)
    src = _tensors(up)
    if "embed_tokens.weight" in src:
        _same("embed_tokens.weight", src["embed_tokens.weight"], embed, up.path)
    elif tuple(embed.shape) != (up.vocab_size, up.hidden_size):
        raise CheckpointError(
            f"{up.path}: the target's embedding is {list(embed.shape)}, the drafter needs "
            f"[{up.vocab_size}, {up.hidden_size}]"
        )
    if "lm_head.weight" in src and up.source != "vllm":
        _same("lm_head.weight", src["lm_head.weight"], lm_head, up.path)
    state = {}
    for ours, t in model.state_dict().items():
        name = mapping.get(ours)
        if name is not None:
            v = src[name]
            if ours == "w1.weight":
                v = torch.cat([v, v.new_zeros(1, v.shape[1])])
            state[ours] = v.to(t.dtype if not t.is_floating_point() else up.dtype)
    if up.kind == "eagle3":
        if up.source == "vllm":
            d2t = src["d2t"].long()
            vocab = torch.arange(up.draft_vocab_size) + d2t
            if (
                int(vocab.max()) >= up.vocab_size
                or int(vocab.min()) < 0
                or len(set(vocab.tolist())) != len(vocab)
            ):
                raise CheckpointError(
                    f"{up.path}: d2t does not map the draft vocabulary onto distinct target ids"
                )
            state["draft_vocab"] = vocab
        else:
            state["draft_vocab"] = torch.arange(up.draft_vocab_size)
    else:
        state["draft_vocab"] = torch.arange(up.draft_vocab_size)
        table = src.get("embed_tokens.weight", embed)
        state["mask_embed"] = table[up.mask_token_id].to(up.dtype).clone()
    model = model.to(up.dtype)
    model.load_state_dict(state, strict=True)
    return model.eval().attach(embed, lm_head)


def imported_meta(up: Upstream) -> dict:
    """What drafter.json records about where an imported drafter came from."""
    return {
        "source": up.source,
        "architecture": up.architecture,
        "path": str(up.path.resolve()),
        "target_layer_ids": list(up.layer_ids),
        "mask_token_id": up.mask_token_id,
        "block_size": up.block_size,
        "markov_head_type": up.markov,
        "dtype": str(up.dtype).removeprefix("torch."),
    }


# -- the target side ---------------------------------------------------------------------------


def target_head_tensors(target_dir: Path) -> tuple:
    """(TargetConfig, embedding, LM head) of an HF target directory, reading only those two
    tensors from its safetensors shards (an 8B target need not be loaded to import a drafter)."""
    from safetensors import safe_open

    from dspark.models.loading import default_feature_layers, hf_config
    from dspark.models.target import TargetConfig

    target_dir = Path(target_dir)
    if (target_dir / "dspark_target.json").exists():
        cfg = TargetConfig.from_dict(json.loads((target_dir / "dspark_target.json").read_text()))
    else:
        hf = hf_config(target_dir)
        cfg = TargetConfig.from_hf(hf, default_feature_layers(hf.num_hidden_layers))
    want = {"model.embed_tokens.weight": None, "lm_head.weight": None}
    for f in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in want:
                if want[k] is None and k in h.keys():
                    want[k] = h.get_tensor(k)
    embed = want["model.embed_tokens.weight"]
    if embed is None:
        raise CheckpointError(f"{target_dir}: no model.embed_tokens.weight in its safetensors files")
    head = want["lm_head.weight"]
    if head is None:
        if not cfg.tie_embeddings:
            raise CheckpointError(f"{target_dir}: no lm_head.weight and the embeddings are not tied")
        head = embed
    return cfg, embed, head


def import_drafter(
    drafter_dir: Path, target_dir: Path, out: Path, layer_ids=None, mask_token_id: int | None = None
) -> tuple[Upstream, object]:
    """Convert an upstream drafter for `target_dir` and write our checkpoint to `out`."""
    up = inspect(drafter_dir, layer_ids, mask_token_id)
    tcfg, embed, head = target_head_tensors(target_dir)
    model = convert(up, embed, head, tcfg)
    model.save(Path(out), extra={"imported": imported_meta(up)}, dtype=up.dtype)
    return up, model
