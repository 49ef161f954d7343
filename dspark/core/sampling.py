"""Sampling parameters, logit warping and inverse-CDF sampling.

One warping function serves the target and the drafter alike: speculative sampling is
lossless with respect to the *warped* target distribution only if the draft distribution q
and the target distribution p are processed by exactly the same temperature / top-k / top-p
rules (reference notes §4, peers.md §4.5). Greedy decoding (temperature < 1e-5) is the
one-hot limit of the same rule, so verification needs no special case for it.

Randomness is explicit: every draw takes uniforms from the request's own generator, so a
request's output depends only on its seed, never on which other requests share its batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

GREEDY_TEMPERATURE = 1e-5  # below this, sampling is argmax (reference notes §1.4)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. The defaults are greedy decoding.

    temperature: 0 (or < 1e-5) means greedy; otherwise logits are divided by it.
    top_k: keep the k most likely tokens (ties at the boundary kept); 0 disables.
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p; 1 disables.
    seed: seeds the request's generator; None draws a fresh seed.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if not isinstance(t, (int, float)) or math.isnan(t) or math.isinf(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or math.isnan(p) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits [..., V] into the warped next-token distribution [..., V] (float32).

    Order as in common serving stacks: temperature, then top-k, then top-p, then renormalise.
    Greedy returns the one-hot of the first argmax.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    z = logits / params.temperature
    if params.top_k and params.top_k < z.shape[-1]:
        kth = torch.topk(z, params.top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    probs = torch.softmax(z, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = mass_before >= params.top_p  # the token that crosses top_p is kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def warp_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """warp() for a batch [R, ..., V] whose rows have their own parameters: greedy rows in one
    argmax (the one-hot `warp` returns for them), the others row by row. Equal to stacking
    warp(logits[r], params[r])."""
    out = torch.zeros(logits.shape, dtype=torch.float32)
    greedy = [r for r, p in enumerate(params) if p.greedy]
    if greedy and logits[..., :1].numel():
        # written in place: no [R, N, V] one-hot (int64) or row copies, which cost more than
        # the per-row loop at 32 rows × 8 positions × 49,152 tokens
        V = logits.shape[-1]
        flat, g = out.view(len(params), -1, V), torch.tensor(greedy)
        top = logits.float().argmax(-1).reshape(len(params), -1)[g]  # [G, M], first maximum
        flat[g.unsqueeze(1), torch.arange(top.shape[1]).unsqueeze(0), top] = 1.0
    for r, p in enumerate(params):
        if not p.greedy:
            out[r] = warp(logits[r], p)
    return out


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample from probs [..., V] with uniforms u [...] in [0, 1).

    Tokens of zero probability are never returned (the search is right-sided, so a zero
    step of the CDF is skipped). Works on unnormalised non-negative weights too.
    """
    cdf = torch.cumsum(probs.double(), dim=-1)
    target = (u.double() * cdf[..., -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def make_generator(seed: int | None) -> torch.Generator:
    """A request's own random stream."""
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed))
    return g


def uniforms(gen: torch.Generator, n: int) -> torch.Tensor:
    """n uniforms in [0, 1) from a request's generator (float64)."""
    return torch.rand(n, generator=gen, dtype=torch.float64)
