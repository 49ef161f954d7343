"""The drafter interface, and a classic autoregressive draft model behind it.

A drafter proposes, for each active request, a block of γ draft tokens x_1..x_γ after the
anchor x_0 (the last committed token), together with

* the distributions q_1..q_γ each token was sampled from (verification needs exactly these),
* one raw confidence logit per slot, where slot k's confidence may depend on x_0..x_{k-1}
  but never on x_k itself (it is "pre-token" information: reference notes §1.6).

The decoding loop tells the drafter what was committed: `begin` with the prompt, `advance`
after every round with the anchor and the accepted drafts (tokens whose target features now
exist), `end` when the request finishes. DSpark's block drafter (parallel backbone + Markov
head + confidence head) implements the same interface; so does `ModelDrafter` below.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch

from dspark.sampling import SamplingParams, sample, uniforms, warp
from dspark.target import LlamaTarget, TargetRunner


@dataclass
class Proposal:
    """A block of drafts per request. `probs` is q_k, the distribution x_k was sampled from:
    over the full vocabulary [R, γ, V], or — when `vocab` is set — over the draft vocabulary
    only ([R, γ, len(vocab)], zero elsewhere by construction), with `index` [R, γ] the position
    of each x_k in `vocab`. The compact form saves materialising γ × V floats per request."""

    tokens: torch.Tensor  # [R, γ] int64, x_1..x_γ
    probs: torch.Tensor  # [R, γ, V] (or [R, γ, Vd] with vocab) float32
    conf_logits: torch.Tensor  # [R, γ] raw confidence logits (before calibration)
    vocab: torch.Tensor | None = None  # [Vd] int64 token ids of the draft vocabulary
    index: torch.Tensor | None = None  # [R, γ] int64, tokens == vocab[index]

    def dense_probs(self, vocab_size: int) -> torch.Tensor:
        """q over the full vocabulary [R, γ, V] (zero outside the draft vocabulary)."""
        if self.vocab is None:
            return self.probs
        out = self.probs.new_zeros(*self.probs.shape[:2], vocab_size)
        out[..., self.vocab] = self.probs
        return out


class Drafter(ABC):
    """Anything that proposes blocks of draft tokens for a batch of requests."""

    block_size: int  # γ: draft tokens per block
    vocab_size: int

    @abstractmethod
    def begin(self, rid: int, token_ids: list[int], features: torch.Tensor) -> None:
        """A new request: its prompt tokens and their target features [P, F]."""

    @abstractmethod
    def propose(
        self,
        rids: list[int],
        anchors: list[int],
        params: list[SamplingParams],
        gens: list[torch.Generator],
    ) -> Proposal:
        """Draft γ tokens after each anchor. Each request draws exactly γ uniforms from its
        generator, in slot order, so its random stream does not depend on the batch."""

    @abstractmethod
    def advance(self, rid: int, token_ids: list[int], features: torch.Tensor) -> None:
        """Tokens now committed to the context (anchor + accepted drafts) and their features."""

    @abstractmethod
    def end(self, rid: int) -> None:
        """The request finished: release everything held for it."""


class ModelDrafter(Drafter):
    """A small causal LM drafting autoregressively (the classic draft-model scheme).

    Slot k's confidence logit is the log-odds of the draft's top probability at T = 1, known
    before x_k is sampled. Its KV cache is kept in sync with the committed context lazily: tokens that
    were committed but not yet seen by the draft model are fed at the next proposal.
    """

    def __init__(self, model: LlamaTarget, block_size: int = 7, num_slots: int = 16, max_len: int = 2048):
        self.runner = TargetRunner(model, num_slots=num_slots, max_len=max_len)
        self.block_size = block_size
        self.vocab_size = model.cfg.vocab_size
        self._slot: dict[int, int] = {}
        self._seen: dict[int, list[int]] = {}  # tokens whose K/V are in the draft cache
        self._context: dict[int, list[int]] = {}  # committed tokens

    def begin(self, rid: int, token_ids: list[int], features: torch.Tensor) -> None:
        self._slot[rid] = self.runner.allocate()
        self._seen[rid] = []
        self._context[rid] = list(token_ids)

    def advance(self, rid: int, token_ids: list[int], features: torch.Tensor) -> None:
        self._context[rid].extend(token_ids)

    def end(self, rid: int) -> None:
        if rid in self._slot:
            self.runner.release(self._slot.pop(rid))
            del self._seen[rid], self._context[rid]

    def _sync(self, rid: int) -> list[int]:
        """Roll the draft cache back to the longest prefix it shares with the context and
        return the committed tokens it has not processed yet."""
        seen, ctx = self._seen[rid], self._context[rid]
        common = 0
        for a, b in zip(seen, ctx):
            if a != b:
                break
            common += 1
        self.runner.rollback(self._slot[rid], common)
        del seen[common:]
        return ctx[common:]

    @torch.no_grad()
    def propose(self, rids, anchors, params, gens) -> Proposal:
        R, gamma = len(rids), self.block_size
        slots = [self._slot[r] for r in rids]
        us = torch.stack([uniforms(g, gamma) for g in gens])  # [R, γ]
        feed = [self._sync(r) + [a] for r, a in zip(rids, anchors)]
        tokens = torch.zeros(R, gamma, dtype=torch.long)
        probs = torch.zeros(R, gamma, self.vocab_size)
        conf = torch.zeros(R, gamma)
        for k in range(gamma):
            out = self.runner.step(slots, feed)
            last = torch.tensor([len(f) - 1 for f in feed])
            logits = out.logits[torch.arange(R), last]  # [R, V]
            for r in range(R):
                self._seen[rids[r]].extend(feed[r])
                q = warp(logits[r], params[r])
                probs[r, k] = q
                top = torch.softmax(logits[r].float(), -1).max().clamp(1e-6, 1 - 1e-6)
                conf[r, k] = torch.log(top) - torch.log1p(-top)
                tokens[r, k] = sample(q, us[r, k])
            feed = [[int(t)] for t in tokens[:, k]]
        return Proposal(tokens, probs, conf)


class DraftModelMixin:
    """What every trained drafter model shares (mixed into an nn.Module with `cfg`, `fc`,
    buffer `draft_vocab`): the frozen target parts and the checkpoint format.

    Checkpoint = `drafter.safetensors` (trainable weights and the draft vocabulary, fp16) +
    `drafter.json` ({"config": ..., plus training summary, STS temperatures, ...})."""

    config_class: type

    def attach(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor):
        """Take the frozen embedding and LM head from the target (never trained, never saved)."""
        V = embed_weight.shape[0]
        dtype = self.fc.weight.dtype
        self.embed = embed_weight.detach().to(dtype)
        self.lm_head = lm_head_weight.detach()[self.draft_vocab].to(dtype)
        to_draft = torch.full((V,), self.cfg.draft_vocab_size, dtype=torch.long)
        to_draft[self.draft_vocab] = torch.arange(self.cfg.draft_vocab_size)
        self.to_draft = to_draft  # target id -> draft index (draft_vocab_size = outside)
        return self

    def save(self, path: Path, extra: dict | None = None) -> None:
        from safetensors.torch import save_file

        path.mkdir(parents=True, exist_ok=True)
        tensors = {
            k: v.detach().to(torch.float16 if v.is_floating_point() else v.dtype).contiguous()
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
