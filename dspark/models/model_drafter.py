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

import torch

from dspark.core.interfaces import Drafter, Proposal
from dspark.core.sampling import sample, uniforms, warp
from dspark.models.target import LlamaTarget, TargetRunner


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
