"""What every trained drafter model shares: the frozen target parts and the checkpoint format."""

from __future__ import annotations

import json
from pathlib import Path

import torch


class DraftModelMixin:
    """What every trained drafter model shares (mixed into an nn.Module with `cfg`, `fc`,
    buffer `draft_vocab`): the frozen target parts and the checkpoint format.

    Checkpoint = `drafter.safetensors` (trainable weights and the draft vocabulary, fp16) +
    `drafter.json` ({"config": ..., plus training summary, STS temperatures, ...})."""

    config_class: type

    def attach(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor):
        """Take the frozen embedding and LM head from the target (never trained, never saved)."""
        V = embed_weight.shape[0]
        dtype = next(self.parameters()).dtype
        self.embed = embed_weight.detach().to(dtype)
        own = getattr(self, "lm_head_weight", None)  # a drafter with its own LM head (imported EAGLE-3)
        self.lm_head = (own if own is not None else lm_head_weight[self.draft_vocab]).detach().to(dtype)
        to_draft = torch.full((V,), self.cfg.draft_vocab_size, dtype=torch.long)
        to_draft[self.draft_vocab] = torch.arange(self.cfg.draft_vocab_size)
        self.to_draft = to_draft  # target id -> draft index (draft_vocab_size = outside)
        return self

    def save(self, path: Path, extra: dict | None = None, dtype: torch.dtype = torch.float16) -> None:
        """Write the checkpoint; floating tensors in `dtype` (fp16 for our trained drafters; an
        imported drafter keeps its upstream dtype, so fp32 and bf16 weights stay exact)."""
        from safetensors.torch import save_file

        path.mkdir(parents=True, exist_ok=True)
        tensors = {
            k: v.detach().to(dtype if v.is_floating_point() else v.dtype).contiguous()
            for k, v in self.state_dict().items()
        }
        save_file(tensors, str(path / "drafter.safetensors"))
        meta = {"config": self.cfg.to_dict(), **(extra or {})}
        (path / "drafter.json").write_text(json.dumps(meta, indent=2))

    @classmethod
    def load(cls, path: Path, dtype: torch.dtype = torch.float32):
        from safetensors.torch import load_file

        meta = json.loads((path / "drafter.json").read_text())
        state = load_file(str(path / "drafter.safetensors"))
        m = cls(cls.config_class(**meta["config"]), state["draft_vocab"])
        m.load_state_dict(state)
        return m.to(dtype).eval()
