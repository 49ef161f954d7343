"""Speculative sampling through the reference loop has exactly the target's law.

Bigram target and drafter with known transition tables (tests/synthetic.py): the exact law of
any window of generated tokens is a product of warped transition matrices, so a chi-square
goodness-of-fit test compares the loop's empirical law with it. The negative control runs the
same test on a deliberately lossy scheduler (retrospective argmax: the paper's Appendix A
counterexample) and must reject it.
"""

import numpy as np
import pytest
from scipy.stats import chisquare

from dspark.core.interfaces import Request
from dspark.core.reference import generate
from dspark.core.sampling import SamplingParams
from dspark.core.scheduler import DSpark, DSparkAsync, Static
from dspark.core.sps import SPSTable
from tests.synthetic import BigramDrafter, BigramTarget, RetrospectiveArgmax, exact_window_law

P_TARGET = np.array([[0.50, 0.30, 0.20], [0.15, 0.60, 0.25], [0.35, 0.25, 0.40]])
Q_DRAFT = np.array([[0.30, 0.50, 0.20], [0.25, 0.55, 0.20], [0.60, 0.20, 0.20]])
GAMMA = 3
CONF_LOGIT = np.array([[1.5, 0.2, -1.0], [2.0, -0.5, 0.5], [0.0, 1.0, -2.0]])  # [slot, previous token]
# step time 1 + 0.35 per batch token: the schedulers pick every length 0..3 depending on confidences
SPS = SPSTable.from_step_times(list(range(1, 33)), [1.0 + 0.35 * b for b in range(1, 33)])
N_SAMPLES, BATCH, MAX_TOKENS = 3000, 4, 8
WINDOWS = [(2, 3), (6, 3)]  # (first generated position, width): right after prefill, and later


def _run(policy, params: SamplingParams, n: int, batch: int, max_tokens: int, seed0: int = 0):
    target, drafter = BigramTarget(P_TARGET), BigramDrafter(Q_DRAFT, CONF_LOGIT, GAMMA)
    outs, lengths = [], np.zeros(GAMMA + 1, dtype=np.int64)
    for b in range(n // batch):
        reqs = [
            Request(
                [0],
                max_tokens=max_tokens,
                params=SamplingParams(params.temperature, params.top_k, params.top_p, seed0 + b * batch + i),
            )
            for i in range(batch)
        ]
        for res in generate(target, reqs, drafter=drafter, policy=policy):
            outs.append(res.tokens)
            v = res.stats.verified_at
            counts = np.concatenate([[res.stats.rounds], v]) if len(v) else np.array([res.stats.rounds])
            for ell in range(len(counts)):  # rounds with ℓ == ell
                nxt = counts[ell + 1] if ell + 1 < len(counts) else 0
                lengths[ell] += counts[ell] - nxt
    return outs, lengths


def _chi2_pvalue(outs, probs, params, start, width) -> float:
    law = exact_window_law(probs, params, first=0, start=start, width=width)
    cells = sorted(law)
    index = {c: i for i, c in enumerate(cells)}
    observed = np.zeros(len(cells))
    for toks in outs:
        observed[index[tuple(toks[start - 1 : start - 1 + width])]] += 1
    expected = np.array([law[c] for c in cells])
    expected = expected / expected.sum() * len(outs)  # warp works in float32
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a token of zero target probability was generated"
    return chisquare(observed[keep], expected[keep]).pvalue


PARAMS = {
    "T=1": SamplingParams(temperature=1.0),
    "T=0.7": SamplingParams(temperature=0.7),
    "T=1,top_p=0.8": SamplingParams(temperature=1.0, top_p=0.8),
}


@pytest.mark.parametrize("policy", [DSpark(SPS), DSparkAsync(SPS), Static(GAMMA)], ids=lambda p: p.name)
@pytest.mark.parametrize("pname", list(PARAMS))
def test_sampling_is_lossless(policy, pname):
    params = PARAMS[pname]
    outs, lengths = _run(policy, params, N_SAMPLES, BATCH, MAX_TOKENS)
    assert all(len(o) == MAX_TOKENS for o in outs)
    if not isinstance(policy, Static):
        assert (lengths > 0).sum() >= 3, f"the scheduler barely varied ℓ ({lengths}): the test is too weak"
    for start, width in WINDOWS:
        p = _chi2_pvalue(outs, P_TARGET, params, start, width)
        assert p > 1e-3, f"{policy.name} {pname}: window {start}..{start + width - 1} deviates (p = {p:.2e})"


# The paper's Appendix A: target (0.7, 0.3), draft (0.5, 0.5), c_1 = 0.8, c_2 = 0.9 after A and
# 0 after B, SPS(1..3) = 1.0, 0.5, 0.45. Retrospective argmax outputs A with probability 0.85.
P_APPX = np.array([[0.7, 0.3], [0.7, 0.3]])
Q_APPX = np.array([[0.5, 0.5], [0.5, 0.5]])
CONF_APPX = np.array([[np.log(0.8 / 0.2)] * 2, [np.log(0.9 / 0.1), -30.0]])
SPS_APPX = SPSTable((1, 2, 3), (1.0, 0.5, 0.45))


def _appendix_a_first_draft_law(policy, n=2000):
    target, drafter = BigramTarget(P_APPX), BigramDrafter(Q_APPX, CONF_APPX, 2)
    counts = np.zeros(2)
    for i in range(n):  # one request per batch (R = 1), as in the counterexample
        req = Request([0], max_tokens=4, params=SamplingParams(temperature=1.0, seed=i))
        counts[generate(target, [req], drafter=drafter, policy=policy)[0].tokens[1]] += 1
    return counts


def test_negative_control_detects_the_retrospective_argmax_bias():
    counts = _appendix_a_first_draft_law(RetrospectiveArgmax(SPS_APPX))
    assert abs(counts[0] / counts.sum() - 0.85) < 0.03
    assert chisquare(counts, np.array([0.7, 0.3]) * counts.sum()).pvalue < 1e-6


@pytest.mark.parametrize("policy", [DSpark(SPS_APPX), DSparkAsync(SPS_APPX)], ids=lambda p: p.name)
def test_appendix_a_case_is_lossless_with_the_break_and_with_async(policy):
    counts = _appendix_a_first_draft_law(policy)
    assert chisquare(counts, np.array([0.7, 0.3]) * counts.sum()).pvalue > 1e-3


def test_negative_control_detects_a_correction_drawn_from_p_instead_of_the_residual(monkeypatch):
    """A subtler lossy variant: after a rejection, sample the correction from p_n itself."""
    import dspark.core.rounds
    from dspark.core.sampling import sample
    from dspark.core.verify import chain_verify

    def lossy(draft_tokens, draft_probs, target_probs, lengths, u, *compact_form):
        v = chain_verify(draft_tokens, draft_probs, target_probs, lengths, u, *compact_form)
        v.next_token = sample(target_probs[np.arange(len(lengths)), v.accepted], u[:, -1])
        return v

    monkeypatch.setattr(dspark.core.rounds, "chain_verify", lossy)
    params = PARAMS["T=1"]
    outs, _ = _run(DSpark(SPS), params, N_SAMPLES, BATCH, MAX_TOKENS)
    assert _chi2_pvalue(outs, P_TARGET, params, *WINDOWS[0]) < 1e-6
