"""Small models whose output law is known exactly, for the statistical losslessness tests.

A bigram target p(x_t | x_{t-1}) and a bigram drafter q(x_t | x_{t-1}) with a confidence
table indexed by the previous token (so slot k's confidence depends on x_{k-1}, exactly the
causal structure of DSpark's confidence head, eq. 7). The law of any window of generated
tokens under the target is a product of (warped) transition matrices.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from dspark.core.interfaces import Drafter, Proposal, TargetStep
from dspark.core.sampling import SamplingParams, sample, uniforms, warp
from dspark.core.scheduler import Policy, candidate_order, prefix_survival
from dspark.core.sps import SPSTable


class BigramTarget:
    """A stateless bigram LM behind the decoding loop's Target interface."""

    def __init__(self, probs: np.ndarray) -> None:
        self.logits = torch.log(torch.as_tensor(probs, dtype=torch.float64)).float()
        self.vocab_size = probs.shape[0]
        self._len: dict[int, int] = {}
        self._next = 0

    def allocate(self) -> int:
        self._next += 1
        self._len[self._next] = 0
        return self._next

    def release(self, slot: int) -> None:
        del self._len[slot]

    def rollback(self, slot: int, length: int) -> None:
        assert 0 <= length <= self._len[slot]
        self._len[slot] = length

    def length(self, slot: int) -> int:
        return self._len[slot]

    def step(self, slots: list[int], tokens: list[list[int]], last_only: bool = False) -> TargetStep:
        N = max(len(t) for t in tokens)
        ids = torch.zeros(len(slots), N, dtype=torch.long)
        for r, (s, t) in enumerate(zip(slots, tokens)):
            ids[r, : len(t)] = torch.tensor(t)
            self._len[s] += len(t)
        if last_only:
            ids_last = torch.tensor([[t[-1]] for t in tokens])
            return TargetStep(self.logits[ids_last], torch.zeros(len(slots), N, 0))
        return TargetStep(self.logits[ids], torch.zeros(len(slots), N, 0))


class BigramDrafter(Drafter):
    """Drafts from a bigram table; slot k's confidence logit is conf_logit[k-1, x_{k-1}]
    (a [γ, V] table), so it depends on the previous token, never on x_k."""

    def __init__(self, probs: np.ndarray, conf_logit: np.ndarray, block_size: int) -> None:
        self.logits = torch.log(torch.as_tensor(probs, dtype=torch.float64)).float()
        self.conf_logit = torch.as_tensor(conf_logit, dtype=torch.float32)
        self.vocab_size = probs.shape[0]
        self.block_size = block_size
        self.open: set[int] = set()

    def begin(self, rid, token_ids, features) -> None:
        self.open.add(rid)

    def advance(self, rid, token_ids, features) -> None:
        assert rid in self.open

    def end(self, rid) -> None:
        self.open.discard(rid)

    def propose(self, rids, anchors, params, gens) -> Proposal:
        R, g = len(rids), self.block_size
        us = torch.stack([uniforms(gen, g) for gen in gens])
        tokens = torch.zeros(R, g, dtype=torch.long)
        probs = torch.zeros(R, g, self.vocab_size)
        conf = torch.zeros(R, g)
        for r in range(R):
            prev = anchors[r]
            for k in range(g):
                q = warp(self.logits[prev], params[r])
                probs[r, k], conf[r, k] = q, self.conf_logit[k, prev]
                prev = int(sample(q, us[r, k]))
                tokens[r, k] = prev
        return Proposal(tokens, probs, conf)


class RetrospectiveArgmax(Policy):
    """LOSSY on purpose (negative control): Algorithm 1's greedy path without the break,
    returning the best point of the whole path. Admission of slot k then depends on
    survivals that depend on x_k itself (reference notes §5.3, the Appendix A counterexample)."""

    name = "retrospective-argmax"

    def __init__(self, sps: SPSTable) -> None:
        self.sps = sps

    def _schedule(self, conf, max_len, stale_conf):
        R = conf.shape[0]
        r_idx, j_idx = candidate_order(prefix_survival(conf), max_len)
        a = prefix_survival(conf)[r_idx, j_idx - 1]
        n = np.arange(len(a) + 1)
        theta = (R + np.concatenate([[0.0], np.cumsum(a)])) * np.array([self.sps(R + k) for k in n])
        best = int(np.argmax(theta))
        return np.bincount(r_idx[:best], minlength=R)


def exact_window_law(probs: np.ndarray, params: SamplingParams, first: int, start: int, width: int) -> dict:
    """Exact law of generated tokens start..start+width-1 (1-based) after prompt token `first`."""
    V = probs.shape[0]
    P = warp(torch.log(torch.as_tensor(probs, dtype=torch.float64)).float(), params).double().numpy()
    dist = np.zeros(V)
    dist[first] = 1.0
    for _ in range(start - 1):
        dist = dist @ P
    law = {}
    for combo in itertools.product(range(V), repeat=width):
        pr = 0.0
        for before in range(V):
            w, prev = dist[before], before
            for t in combo:
                w *= P[prev, t]
                prev = t
            pr += w
        law[combo] = pr
    return law
