import torch

from dspark.core.verify import chain_verify, commit_tokens


def _one_position_law(p: torch.Tensor, q: torch.Tensor, grid: int = 300) -> torch.Tensor:
    """Law of the first emitted token, integrating x ~ q exactly and both uniforms on a grid."""
    V = p.shape[0]
    g = (torch.arange(grid, dtype=torch.float64) + 0.5) / grid
    u_acc, u_res = torch.meshgrid(g, g, indexing="ij")
    u = torch.stack([u_acc.reshape(-1), u_res.reshape(-1)], dim=1)  # [M, γ+1] with γ = 1
    M = u.shape[0]
    law = torch.zeros(V, dtype=torch.float64)
    for x in range(V):
        if q[x] == 0:
            continue
        v = chain_verify(
            torch.full((M, 1), x),
            q.expand(M, 1, V),
            torch.stack([p, p]).expand(M, 2, V),
            torch.ones(M, dtype=torch.long),
            u,
        )
        emitted = torch.where(v.accepted == 1, torch.full((M,), x), v.next_token)
        law += q[x].double() * torch.bincount(emitted, minlength=V).double() / M
    return law


def test_one_position_emits_exactly_the_target_law():
    torch.manual_seed(0)
    for _ in range(4):
        p = torch.softmax(torch.randn(5) * 1.5, 0)
        q = torch.softmax(torch.randn(5) * 1.5, 0)
        assert torch.allclose(_one_position_law(p, q), p.double(), atol=4e-3)


def test_draft_with_disjoint_support_is_always_corrected_to_the_target_law():
    p = torch.tensor([0.6, 0.4, 0.0, 0.0])
    q = torch.tensor([0.0, 0.0, 0.5, 0.5])
    assert torch.allclose(_one_position_law(p, q), p.double(), atol=4e-3)


def test_identical_draft_is_always_accepted():
    p = torch.softmax(torch.randn(6), 0)
    u = torch.rand(50, 4, dtype=torch.float64)
    x = torch.multinomial(p, 50 * 3, replacement=True).view(50, 3)
    v = chain_verify(x, p.expand(50, 3, 6), p.expand(50, 4, 6), torch.full((50,), 3), u)
    assert v.accepted.tolist() == [3] * 50


def _onehot(idx, V=7):
    return torch.nn.functional.one_hot(torch.tensor(idx), V).float()


def test_greedy_accepts_exact_argmax_matches_and_corrects_with_the_target_argmax():
    target_argmax = [3, 5, 1, 6]  # p_0..p_3
    p = _onehot(target_argmax).unsqueeze(0)
    u = torch.rand(1, 4, dtype=torch.float64)
    drafts = torch.tensor([[3, 5, 2]])  # third draft wrong
    v = chain_verify(drafts, _onehot([3, 5, 2]).unsqueeze(0), p, torch.tensor([3]), u)
    assert (v.accepted.item(), v.next_token.item()) == (2, 1)
    drafts = torch.tensor([[3, 5, 1]])  # all right: bonus is argmax of p_3
    v = chain_verify(drafts, _onehot([3, 5, 1]).unsqueeze(0), p, torch.tensor([3]), u)
    assert (v.accepted.item(), v.next_token.item()) == (3, 6)


def test_drafts_past_the_verification_length_are_ignored():
    p = _onehot([3, 5, 1, 6]).unsqueeze(0)
    drafts = torch.tensor([[3, 5, 1]])
    q = _onehot([3, 5, 1]).unsqueeze(0)
    u = torch.rand(1, 4, dtype=torch.float64)
    v = chain_verify(drafts, q, p, torch.tensor([1]), u)
    assert (v.accepted.item(), v.next_token.item()) == (1, 5)  # bonus from p_1
    v = chain_verify(drafts, q, p, torch.tensor([0]), u)
    assert (v.accepted.item(), v.next_token.item()) == (0, 3)  # ℓ = 0: plain target token


def test_residual_without_mass_falls_back_to_the_target():
    # q exceeds p at x by 1e-10: a rejection leaves residual mass 1e-10 < 1e-8, so the
    # correction is drawn from p itself (u = 0.1 -> token 0), not from the residual (token 1)
    p = torch.tensor([[[0.5, 0.5], [0.5, 0.5]]], dtype=torch.float64)
    q = torch.tensor([[[0.5 + 1e-10, 0.5 - 1e-10]]], dtype=torch.float64)
    u = torch.tensor([[1 - 1e-12, 0.1]], dtype=torch.float64)
    v = chain_verify(torch.tensor([[0]]), q, p, torch.tensor([1]), u)
    assert (v.accepted.item(), v.next_token.item()) == (0, 0)


def test_commit_stops_at_an_accepted_stop_token_without_bonus():
    c = commit_tokens([4, 0, 7], accepted=3, next_token=9, stop_ids=frozenset({0}), remaining=10)
    assert (c.tokens, c.finished, c.stopped) == ([4, 0], True, True)


def test_commit_appends_correction_and_finishes_on_a_stop_correction():
    c = commit_tokens([4, 5], accepted=1, next_token=0, stop_ids=frozenset({0}), remaining=10)
    assert (c.tokens, c.finished, c.stopped) == ([4, 0], True, False)
    c = commit_tokens([4, 5], accepted=2, next_token=8, stop_ids=frozenset({0}), remaining=10)
    assert (c.tokens, c.finished) == ([4, 5, 8], False)


def test_commit_never_exceeds_max_tokens():
    c = commit_tokens([4, 5, 6], accepted=3, next_token=8, stop_ids=frozenset(), remaining=2)
    assert (c.tokens, c.finished) == ([4, 5], True)
    c = commit_tokens([4], accepted=1, next_token=8, stop_ids=frozenset(), remaining=2)
    assert (c.tokens, c.finished) == ([4, 8], True)


def _random_round(g, R, G, V, vocab, max_len):
    """A random compact proposal over `vocab`, target distributions over γ + 1 positions,
    lengths in [0, max_len] and uniforms: (proposal, p, lengths, u)."""
    from dspark.core.interfaces import Proposal
    from dspark.core.sampling import sample

    q = torch.softmax(torch.randn(R, G, len(vocab), generator=g) * 2, -1)
    index = sample(q, torch.rand(R, G, generator=g))
    prop = Proposal(vocab[index], q, torch.zeros(R, G), vocab=vocab, index=index)
    p = torch.softmax(torch.randn(R, G + 1, V, generator=g) * 2, -1)
    lengths = torch.randint(0, max_len + 1, (R,), generator=g)
    return prop, p, lengths, torch.rand(R, G + 1, generator=g)


def test_compact_draft_distributions_verify_exactly_like_dense_ones():
    """Proposal's compact form (q over a draft vocabulary + indices) gives the same verdicts as
    the same q scattered over the full vocabulary, for every row, length and uniform."""
    g = torch.Generator().manual_seed(0)
    R, G, V = 6, 5, 40
    vocab = torch.randperm(V, generator=g)[:12]
    for _ in range(20):
        prop, p, lengths, u = _random_round(g, R, G, V, vocab, G)
        q, index = prop.probs, prop.index
        dense = chain_verify(prop.tokens, prop.dense_probs(V), p, lengths, u)
        compact = chain_verify(prop.tokens, q, p, lengths, u, vocab, index)
        assert torch.equal(dense.accepted, compact.accepted)
        assert torch.equal(dense.next_token, compact.next_token)


def test_target_probs_over_max_length_plus_one_positions_verify_like_the_full_block():
    """A step verifies max ℓ + 1 inputs; p over those positions only (no padding to γ + 1)
    gives the same verdicts, dense and compact; fewer positions than some ℓ needs is an error."""
    import pytest

    g = torch.Generator().manual_seed(1)
    R, G, V = 5, 6, 30
    vocab = torch.randperm(V, generator=g)[:10]
    for trial in range(40):
        prop, p, lengths, u = _random_round(g, R, G, V, vocab, trial % (G + 1))
        q, index = prop.probs, prop.index
        n = int(lengths.max()) + 1
        full = chain_verify(prop.tokens, prop.dense_probs(V), p, lengths, u)
        for got in (
            chain_verify(prop.tokens, prop.dense_probs(V), p[:, :n], lengths, u),
            chain_verify(prop.tokens, q, p[:, :n], lengths, u, vocab, index),
        ):
            assert torch.equal(got.accepted, full.accepted) and torch.equal(got.next_token, full.next_token)
        if n > 1:
            with pytest.raises(ValueError, match="target positions"):
                chain_verify(prop.tokens, q, p[:, : n - 1], lengths, u, vocab, index)


def test_a_round_verifies_its_rows_grouped_by_length_exactly_like_one_padded_batch():
    """rounds.verify warps and verifies rows grouped by ℓ (a step's logits are padded to the
    longest row): same verdicts as one batch over max ℓ + 1 positions, for greedy and sampled
    rows, drafting and non-drafting ones, dense or compact q."""
    import numpy as np

    from dspark.core import rounds
    from dspark.core.interfaces import Request, SamplingParams, TargetStep
    from dspark.core.sampling import make_generator, uniforms, warp_rows

    g = torch.Generator().manual_seed(7)
    R, G, V = 9, 5, 40
    vocab = torch.randperm(V, generator=g)[:14]

    class Fixed:  # the target's step: these logits, whatever the tokens
        def __init__(self, logits):
            self.logits = logits

        def length(self, slot):
            return 10

        def step(self, slots, tokens, last_only=False):
            n = max(len(t) for t in tokens)
            return TargetStep(self.logits[:, :n], torch.zeros(len(slots), n, 4))

    params = [
        SamplingParams(),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.8),
        SamplingParams(temperature=1.2, top_k=5),
    ]
    for trial in range(30):
        prop, _, lengths, _ = _random_round(g, R, G, V, vocab, G)
        drafting = (torch.rand(R, generator=g) < 0.6).numpy()
        lengths = np.where(drafting, lengths.numpy(), 0).astype(np.int64)
        logits = torch.randn(R, G + 1, V, generator=g) * 3
        seqs = []
        for r in range(R):
            req = Request([1, 2], max_tokens=50, params=params[(r + trial) % len(params)])
            s = rounds.SequenceState(r, req, r, make_generator(100 * trial + r))
            s.out = [3]
            seqs.append(s)
        compact = trial % 2 == 0
        d = rounds.Draft(
            prop.tokens,
            prop.probs if compact else prop.dense_probs(V),
            np.zeros((R, G)),
            drafting,
            vocab if compact else None,
            prop.index if compact else None,
        )
        got = rounds.verify(Fixed(logits), seqs, d, lengths).verdict
        # the same uniforms, drawn again from fresh generators, through one padded batch
        u = torch.stack([uniforms(make_generator(100 * trial + r), G + 1) for r in range(R)])
        n = int(lengths.max()) + 1
        p = warp_rows(logits[:, :n], [s.req.params for s in seqs])
        want = chain_verify(d.tokens, d.probs, p, torch.from_numpy(lengths), u, d.vocab, d.index)
        assert torch.equal(got.accepted, want.accepted), trial
        assert torch.equal(got.next_token, want.next_token), trial
