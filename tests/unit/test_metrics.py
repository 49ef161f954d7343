"""Acceptance metrics as defined in reference notes §6.2 (τ with bonus, survival, conditional)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from dspark.core.metrics import AcceptanceStats, RoundRecord

# Hand-worked batch (γ = 3), mixing proposal lengths, an ℓ = 0 round and a stopped round:
#   round  verified  accepted  stopped  committed
#     1        3         3       no        4
#     2        3         1       no        2
#     3        2         0       no        1
#     4        0         0       no        1      (ℓ = 0: the target decodes one token)
#     5        3         2       yes       2      (EOS accepted at slot 2, no bonus)
PROPOSED = [3, 3, 2, 0, 3]
ACCEPTED = [3, 1, 0, 0, 2]
STOPPED = [False, False, False, False, True]


def hand_stats() -> AcceptanceStats:
    stats = AcceptanceStats()
    for p, a, s in zip(PROPOSED, ACCEPTED, STOPPED, strict=True):
        stats.add(RoundRecord(verified=p, accepted=a, stopped=s))
    return stats


def test_round_record_commits_bonus_unless_stopped() -> None:
    assert RoundRecord(verified=7, accepted=3).committed == 4
    assert RoundRecord(verified=7, accepted=3, stopped=True).committed == 3
    assert RoundRecord(verified=0, accepted=0).committed == 1


def test_round_record_rejects_impossible_rounds() -> None:
    with pytest.raises(ValueError, match="cannot accept more"):
        RoundRecord(verified=2, accepted=3)
    with pytest.raises(ValueError, match="≥ 0"):
        RoundRecord(verified=-1, accepted=0)
    with pytest.raises(ValueError, match="stopped=True needs accepted ≥ 1"):
        RoundRecord(verified=3, accepted=0, stopped=True)
    with pytest.raises(TypeError, match="int"):
        RoundRecord(verified=2.0, accepted=1)  # type: ignore[arg-type]


def test_tau_counts_bonus_token_except_on_stopped_rounds() -> None:
    stats = hand_stats()
    assert stats.rounds == 5
    assert stats.committed_tokens == 4 + 2 + 1 + 1 + 2
    assert stats.tau == pytest.approx(10 / 5)


def test_survival_is_unconditional_over_rounds_that_verified_the_slot() -> None:
    stats = hand_stats()
    # verified: k=1: rounds 1,2,3,5 (4); k=2: 1,2,3,5 (4); k=3: 1,2,5 (3)
    # accepted ≥ k: k=1: 1,2,5 (3); k=2: 1,5 (2); k=3: 1 (1)
    assert stats.verified_at.tolist() == [4, 4, 3]
    assert stats.accepted_at.tolist() == [3, 2, 1]
    assert [stats.survival(k) for k in (1, 2, 3)] == pytest.approx([3 / 4, 2 / 4, 1 / 3])


def test_conditional_is_acceptance_among_rounds_that_reached_the_slot() -> None:
    stats = hand_stats()
    # reached (verified ≥ k and accepted ≥ k−1): k=1: 1,2,3,5 (4); k=2: 1,2,5 (3); k=3: 1,5 (2)
    assert stats.reached_at.tolist() == [4, 3, 2]
    assert [stats.conditional(k) for k in (1, 2, 3)] == pytest.approx([3 / 4, 2 / 3, 1 / 2])


def test_verify_rate_and_lengths_match_hand_counts() -> None:
    stats = hand_stats()
    assert stats.verify_rate == pytest.approx(10 / (11 + 5))
    assert stats.mean_verify_len == pytest.approx(11 / 5)
    assert stats.draft_acceptance_rate == pytest.approx(6 / 11)
    assert stats.stopped_rounds == 1
    assert stats.gamma == 3


def test_undefined_metrics_are_nan_and_positions_are_one_based() -> None:
    empty = AcceptanceStats()
    assert math.isnan(empty.tau) and math.isnan(empty.verify_rate) and math.isnan(empty.mean_verify_len)
    assert math.isnan(empty.survival(1)) and math.isnan(empty.conditional(1))
    only_l0 = AcceptanceStats()
    only_l0.add(RoundRecord(verified=0, accepted=0))
    assert only_l0.tau == 1.0 and only_l0.verify_rate == 1.0
    assert math.isnan(only_l0.draft_acceptance_rate) and math.isnan(only_l0.survival(1))
    with pytest.raises(ValueError, match="1-based"):
        hand_stats().survival(0)


def test_add_many_equals_adding_rounds_one_by_one() -> None:
    batch = AcceptanceStats()
    batch.add_many(PROPOSED, ACCEPTED, STOPPED)
    assert batch == hand_stats()
    assert batch.to_dict() == hand_stats().to_dict()


def test_add_many_rejects_inconsistent_arrays() -> None:
    stats = AcceptanceStats()
    with pytest.raises(ValueError, match="one entry per round"):
        stats.add_many([3, 3], [1])
    with pytest.raises(ValueError, match="cannot accept more"):
        stats.add_many([2], [3])
    with pytest.raises(ValueError, match="stopped=True needs accepted ≥ 1"):
        stats.add_many([2], [0], [True])
    with pytest.raises(ValueError, match="integer"):
        stats.add_many([2.5], [1])
    assert stats == AcceptanceStats()  # a rejected batch leaves no partial counts


def test_merge_equals_adding_all_rounds_to_one_accumulator() -> None:
    rng = np.random.default_rng(3)
    verified = rng.integers(0, 8, size=400)
    accepted = np.array([rng.integers(0, p + 1) for p in verified])
    stopped = (accepted > 0) & (rng.random(400) < 0.1)
    whole = AcceptanceStats()
    whole.add_many(verified, accepted, stopped)
    left, right = AcceptanceStats(), AcceptanceStats()
    left.add_many(verified[:100], accepted[:100], stopped[:100])
    for p, a, s in zip(verified[100:], accepted[100:], stopped[100:], strict=True):
        right.add(RoundRecord(int(p), int(a), bool(s)))
    assert left.merge(right) == whole
    # merging into an accumulator with shorter counters grows them
    short = AcceptanceStats()
    short.add(RoundRecord(verified=1, accepted=1))
    grown = short.merge(whole)
    expected = AcceptanceStats()
    expected.add(RoundRecord(verified=1, accepted=1))
    expected.add_many(verified, accepted, stopped)
    assert grown == expected


def test_conditional_equals_ratio_of_survivals_when_all_rounds_propose_gamma() -> None:
    gamma = 7
    rng = np.random.default_rng(4)
    accepted = rng.integers(0, gamma + 1, size=1000)
    stats = AcceptanceStats()
    stats.add_many(np.full(1000, gamma), accepted)
    assert stats.conditional(1) == pytest.approx(stats.survival(1))
    for k in range(2, gamma + 1):
        assert stats.conditional(k) == pytest.approx(stats.survival(k) / stats.survival(k - 1))
    # and τ = 1 + Σ_k survival_k (peers.md §3.2), bonus included
    assert stats.tau == pytest.approx(1 + sum(stats.survival(k) for k in range(1, gamma + 1)))


def test_tau_of_constant_alpha_process_approaches_closed_form() -> None:
    gamma, alpha, n = 7, 0.8, 200_000
    rng = np.random.default_rng(980406)
    ok = rng.random((n, gamma)) < alpha
    accepted = np.where(ok.all(axis=1), gamma, np.argmin(ok, axis=1))
    stats = AcceptanceStats()
    stats.add_many(np.full(n, gamma), accepted)
    assert stats.tau == pytest.approx((1 - alpha ** (gamma + 1)) / (1 - alpha), abs=0.05)
    assert all(stats.conditional(k) == pytest.approx(alpha, abs=0.02) for k in range(1, gamma + 1))


def test_to_dict_pads_to_requested_gamma_and_json_dict_has_no_nan() -> None:
    stats = hand_stats()
    d = stats.to_dict(gamma=5)
    assert d["rounds"] == 5 and d["tau"] == pytest.approx(2.0)
    assert d["verified_per_position"] == [4, 4, 3, 0, 0]
    assert d["accepted_per_position"] == [3, 2, 1, 0, 0]
    assert len(d["survival"]) == 5 and math.isnan(d["survival"][4])
    j = stats.to_json_dict(gamma=5)
    assert j["survival"][3:] == [None, None] and j["conditional"][3:] == [None, None]
    json.dumps(j, allow_nan=False)
    assert set(d) >= {
        "rounds",
        "tau",
        "survival",
        "conditional",
        "verify_rate",
        "mean_verify_len",
        "accepted_per_position",
        "verified_per_position",
    }
