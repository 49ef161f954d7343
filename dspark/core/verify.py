"""Lossless verification: batched chain speculative sampling (reference notes §4).

For request r with verification length ℓ_r, drafts x_1..x_ℓ sampled from q_1..q_ℓ and
target distributions p_0..p_ℓ (p_j = the target's warped distribution for the token after
verify input j, inputs being [x_0, x_1..x_ℓ]):

* accept x_k with probability min(1, p_{k-1}(x_k) / q_k(x_k)), left to right, stopping at
  the first rejection (Leviathan et al. 2023; Chen et al. 2023);
* on a rejection at k, emit a correction drawn from the residual ∝ max(0, p_{k-1} − q_k)
  (falling back to p_{k-1} when the residual has no mass, i.e. p ≈ q);
* if all ℓ drafts are accepted (or ℓ = 0), emit a bonus token drawn from p_ℓ.

Each round therefore emits the accepted drafts plus exactly one target token, and the
emitted sequence has exactly the (warped) target law: the accept branch contributes
min(p, q), the residual branch (p − q)_+, together p. Greedy decoding is the one-hot case of
the same arithmetic: accept iff the draft equals the target argmax, correct with the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.core.sampling import sample

RESIDUAL_EPS = 1e-8  # residual mass below this means p ≈ q: sample from p (reference §4 step 5)


@dataclass
class Verdict:
    """Outcome of verifying one round for a batch of R requests."""

    accepted: torch.Tensor  # [R] int64, number of accepted drafts n_r (0..ℓ_r)
    next_token: torch.Tensor  # [R] int64, the correction (n < ℓ) or bonus (n = ℓ) token


def chain_verify(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    lengths: torch.Tensor,
    u: torch.Tensor,
    draft_vocab: torch.Tensor | None = None,
    draft_index: torch.Tensor | None = None,
) -> Verdict:
    """Verify a batch of draft blocks.

    draft_tokens: [R, γ] int64, x_1..x_γ (entries past ℓ_r are ignored).
    draft_probs:  [R, γ, V], q_k: exactly the distribution x_k was sampled from.
    target_probs: [R, N, V], p_0..p_{N-1}, warped with the same rule as q (past ℓ_r ignored);
                  N ≤ γ+1 is enough when every ℓ_r ≤ N − 1 (a step verifies max ℓ_r + 1 inputs).
    lengths:      [R] int64, ℓ_r ∈ [0, γ].
    u:            [R, γ+1] uniforms in [0, 1): u[:, k-1] decides draft k, u[:, γ] samples the
                  correction/bonus token.
    draft_vocab, draft_index: when set, draft_probs is [R, γ, Vd] over the token ids draft_vocab
                  (q is zero elsewhere) and draft_tokens == draft_vocab[draft_index]
                  (Proposal's compact form); the result is identical to the dense form.
    """
    R, gamma = draft_tokens.shape
    if gamma == 0:
        bonus = sample(target_probs[:, 0], u[:, 0])
        return Verdict(torch.zeros(R, dtype=torch.long), bonus)
    G = min(gamma, target_probs.shape[1] - 1)  # drafts that can be verified with these p
    if R and int(lengths.max()) > G:
        n = int(lengths.max())
        raise ValueError(f"verifying {n} drafts needs {n + 1} target positions, got {G + 1}")
    idx = draft_tokens[:, :G].unsqueeze(-1)
    # gather first, then widen: the same numbers as widening [R, γ, V] first, without
    # converting whole vocabularies every round
    p_at_x = target_probs[:, :G].gather(-1, idx).squeeze(-1).double()  # p_{k-1}(x_k)
    q_idx = idx if draft_vocab is None or draft_index is None else draft_index[:, :G].unsqueeze(-1)
    q_at_x = draft_probs[:, :G].gather(-1, q_idx).squeeze(-1).double()  # q_k(x_k)
    # u < p/q without dividing: a draft with q = 0 could not have been sampled
    ok = u[:, :G].double() * q_at_x < p_at_x
    in_range = torch.arange(G).unsqueeze(0) < lengths.unsqueeze(1)
    ok = ok & in_range
    accepted = torch.cumprod(ok.long(), dim=1).sum(dim=1)  # length of the all-accepted prefix

    rows = torch.arange(R)
    p_next = target_probs[rows, accepted].double()  # p_n: distribution after the last kept input
    rejected = accepted < lengths
    q_next = draft_probs[rows, accepted.clamp(max=gamma - 1)].double()
    if draft_vocab is not None:  # back to the full vocabulary, for these R rows only
        q_next = q_next.new_zeros(R, p_next.shape[-1]).index_copy_(1, draft_vocab, q_next)
    residual = torch.where(rejected.unsqueeze(-1), (p_next - q_next).clamp(min=0.0), p_next)
    no_mass = residual.sum(-1, keepdim=True) <= RESIDUAL_EPS
    dist = torch.where(no_mass, p_next, residual)
    return Verdict(accepted, sample(dist, u[:, gamma]))


@dataclass
class Commit:
    """What one request commits in one round."""

    tokens: list[int]  # emitted tokens, in order
    finished: bool  # a stop token was emitted or max_tokens reached
    stopped: bool  # finished because a stop token was emitted inside the accepted drafts


def commit_tokens(
    drafts: list[int], accepted: int, next_token: int, stop_ids: frozenset[int], remaining: int
) -> Commit:
    """Tokens a request emits after verification, with stop tokens and max_tokens applied.

    A stop token among the accepted drafts ends the sequence there (inclusive) with no bonus
    token; a stop token as the correction/bonus ends it too. At most `remaining` tokens are
    emitted (truncating a correctly distributed sequence keeps it correctly distributed).
    """
    kept = drafts[:accepted]
    for i, t in enumerate(kept):
        if t in stop_ids:
            out = kept[: i + 1]
            if len(out) > remaining:
                return Commit(out[:remaining], True, False)
            return Commit(out, True, True)
    out = kept + [next_token]
    if len(out) >= remaining:
        out = out[:remaining]
        return Commit(out, True, False)
    return Commit(out, next_token in stop_ids, False)
