"""Tests for dspark.core.scheduler: SPS(B) lookup, Algorithm 1, asynchronous top-K and simple policies.

References: DSpark paper §3.2.2 (Algorithm 1), §5.2 (asynchronous scheduling), App. A
(non-anticipation counterexample); digest /work/shared/reference/dspark-algorithm.md §5.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dspark.core.scheduler import (
    MODES,
    DSpark,
    DSparkAsync,
    Off,
    Policy,
    Static,
    Threshold,
    candidate_order,
    policy_for,
    prefix_survival,
)
from dspark.core.sps import SPSTable

# ---------------------------------------------------------------------------------------------
# Local references and generators (deliberately written as plain loops, not like the module)
# ---------------------------------------------------------------------------------------------


def theta(lengths: np.ndarray, conf: np.ndarray, sps: SPSTable) -> float:
    """Θ = τ · SPS(B) for a length vector (digest §5.1)."""
    n_requests = conf.shape[0]
    tau = float(n_requests)
    for r in range(n_requests):
        survival = 1.0
        for j in range(int(lengths[r])):
            survival *= conf[r, j]
            tau += survival
    return tau * sps(n_requests + int(np.sum(lengths)))


def exhaustive_optimum(conf: np.ndarray, max_len: np.ndarray, sps: SPSTable) -> float:
    """max Θ over every ℓ in ∏_r {0..max_len_r}."""
    ranges = [range(int(m) + 1) for m in max_len]
    return max(theta(np.array(lengths), conf, sps) for lengths in itertools.product(*ranges))


def greedy_path(conf: np.ndarray, max_len: np.ndarray) -> list[np.ndarray]:
    """ℓ vectors along the sorted path: point n admits the n best candidates (a > 0)."""
    n_requests, gamma = conf.shape
    survival = {}
    for r in range(n_requests):
        a = 1.0
        for j in range(1, gamma + 1):
            a *= conf[r, j - 1]
            if a > 0 and j <= max_len[r]:
                survival[(r, j)] = a
    ranked = sorted(survival, key=lambda rj: (-survival[rj], rj[1], rj[0]))
    lengths = np.zeros(n_requests, dtype=np.int64)
    path = [lengths.copy()]
    for r, j in ranked:
        lengths[r] = j
        path.append(lengths.copy())
    return path


def reference_algorithm1(conf: np.ndarray, max_len: np.ndarray, sps: SPSTable) -> np.ndarray:
    """Algorithm 1 exactly as written in the paper, as a loop with the break."""
    path = greedy_path(conf, max_len)
    best = theta(path[0], conf, sps)
    committed = path[0]
    for lengths in path[1:]:
        value = theta(lengths, conf, sps)
        if value > best:
            best, committed = value, lengths
        else:
            break
    return committed


def retrospective_argmax(conf: np.ndarray, max_len: np.ndarray, sps: SPSTable) -> np.ndarray:
    """Best point over the WHOLE greedy path on current confidences (no break): anticipating."""
    path = greedy_path(conf, max_len)
    values = [theta(lengths, conf, sps) for lengths in path]
    return path[int(np.argmax(values))]


def random_table(rng: np.random.Generator, b_max: int) -> SPSTable:
    """Either a smoothly decreasing SPS curve or a jagged (staircase, possibly non-monotone) one."""
    batch = np.arange(1, b_max + 1)
    if rng.random() < 0.5:
        seconds = rng.uniform(0.5, 2.0) + np.cumsum(rng.uniform(0.0, 0.6, size=b_max))
    else:
        bucket = int(rng.integers(1, 5))
        seconds = rng.uniform(0.5, 2.0) + rng.uniform(0.1, 1.0) * np.ceil(batch / bucket)
        seconds = seconds * rng.uniform(0.85, 1.15, size=b_max)
    return SPSTable.from_step_times(batch.tolist(), seconds.tolist())


def random_conf(rng: np.random.Generator, n_requests: int, gamma: int, allow_zero: bool) -> np.ndarray:
    """Confidences with deliberate ties: exact ones and a shared repeated value."""
    conf = rng.uniform(0.05, 1.0, size=(n_requests, gamma))
    conf[rng.random(conf.shape) < 0.2] = 1.0
    conf[rng.random(conf.shape) < 0.15] = 0.5
    if allow_zero:
        conf[rng.random(conf.shape) < 0.1] = 0.0
    return conf


def linear_table(b_max: int = 512) -> SPSTable:
    """Compute-bound-ish curve: step time = 10 ms + 2 ms · B."""
    batch = list(range(1, b_max + 1))
    return SPSTable.from_step_times(batch, [0.010 + 0.002 * b for b in batch])


def is_unimodal(values: list[float]) -> bool:
    """Strictly increasing up to the maximum, then non-increasing."""
    m = 0
    while m + 1 < len(values) and values[m + 1] > values[m]:
        m += 1
    return all(values[i + 1] <= values[i] for i in range(m, len(values) - 1))


def prefix_counts(conf: np.ndarray, max_len: np.ndarray, n: int) -> np.ndarray:
    r_idx, _ = candidate_order(prefix_survival(conf), max_len)
    return np.bincount(r_idx[:n], minlength=conf.shape[0])


# ---------------------------------------------------------------------------------------------
# SPS(B) table
# ---------------------------------------------------------------------------------------------

TABLE = SPSTable(batch_tokens=(2, 4, 8), steps_per_second=(100.0, 50.0, 20.0))


def test_sps_is_exact_at_measured_points():
    for b, s in zip(TABLE.batch_tokens, TABLE.steps_per_second, strict=True):
        assert TABLE(b) == pytest.approx(s, rel=1e-15)
        assert TABLE.step_time(b) == pytest.approx(1.0 / s, rel=1e-15)


def test_sps_halfway_step_time_is_mean_of_neighbouring_step_times():
    assert TABLE.step_time(3) == pytest.approx((1 / 100 + 1 / 50) / 2)
    assert TABLE.step_time(6) == pytest.approx((1 / 50 + 1 / 20) / 2)
    assert TABLE(6) == pytest.approx(1.0 / ((1 / 50 + 1 / 20) / 2))


def test_sps_below_smallest_measured_batch_uses_smallest_step_time():
    assert TABLE(1) == pytest.approx(100.0)


def test_sps_above_largest_measured_batch_extrapolates_step_time_proportionally():
    assert TABLE.step_time(16) == pytest.approx(2 * (1 / 20))
    assert TABLE.step_time(12) == pytest.approx(1.5 * (1 / 20))


def test_sps_single_point_table_is_flat_below_and_proportional_above():
    table = SPSTable((4,), (10.0,))
    assert table(1) == pytest.approx(10.0)
    assert table(4) == pytest.approx(10.0)
    assert table(8) == pytest.approx(5.0)


def test_sps_batch_below_one_raises():
    with pytest.raises(ValueError, match="B >= 1"):
        TABLE(0)
    with pytest.raises(ValueError, match="B >= 1"):
        TABLE.step_time(-3)


def test_sps_json_round_trip_keeps_values_and_meta(tmp_path):
    table = SPSTable.from_step_times(
        [1, 3, 7], [0.0123, 0.0171, 0.031], meta={"context": 2048, "gpu": "none"}
    )
    path = tmp_path / "sps.json"
    table.to_json(path)
    loaded = SPSTable.from_json(path)
    assert loaded == table
    assert loaded.meta == {"context": 2048, "gpu": "none"}
    assert SPSTable.from_dict(table.to_dict()) == table


def test_sps_from_step_times_inverts_seconds():
    table = SPSTable.from_step_times([1, 2], [0.5, 0.25])
    assert table.steps_per_second == (2.0, 4.0)


def _isotonic_brute_force(y: list[float]) -> list[float]:
    """The closed form of the non-decreasing least-squares fit: x_i = max_{j<=i} min_{k>=i} mean(y[j..k])."""
    n = len(y)
    return [
        max(min(float(np.mean(y[j : k + 1])) for k in range(i, n)) for j in range(i + 1)) for i in range(n)
    ]


def test_sps_monotone_fit_equals_brute_force_isotonic_regression():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 9))
        t = rng.uniform(0.01, 0.05, n)
        fitted = SPSTable.from_step_times(list(range(1, n + 1)), t, {"context": 256}).monotone()
        got = [fitted.step_time(b) for b in range(1, n + 1)]
        assert got == pytest.approx(_isotonic_brute_force(list(t)), rel=1e-12)
        assert all(a <= b + 1e-15 for a, b in zip(got, got[1:]))
        assert fitted.meta["context"] == 256 and "isotonic" in fitted.meta["fit"]


def test_sps_monotone_fit_pools_a_noisy_dip_and_keeps_a_monotone_curve():
    noisy = SPSTable.from_step_times([1, 2, 3, 4], [0.023, 0.031, 0.029, 0.033])
    assert [round(noisy.monotone().step_time(b), 6) for b in (1, 2, 3, 4)] == [0.023, 0.03, 0.03, 0.033]
    clean = SPSTable.from_step_times([1, 2, 4], [0.02, 0.025, 0.03])
    assert clean.monotone() == clean


def test_sps_lists_are_stored_as_tuples_and_table_is_hashable():
    table = SPSTable([1, 2], [3, 4])
    assert table.batch_tokens == (1, 2)
    assert table.steps_per_second == (3.0, 4.0)
    assert hash(table) == hash(SPSTable((1, 2), (3.0, 4.0), meta={"x": 1}))


@pytest.mark.parametrize(
    ("batch_tokens", "sps", "message"),
    [
        ((), (), "empty"),
        ((1, 2), (1.0,), "length mismatch"),
        ((2, 1), (1.0, 1.0), "strictly increasing"),
        ((1, 1), (1.0, 1.0), "duplicate"),
        ((0, 1), (1.0, 1.0), ">= 1"),
        ((1, 2), (1.0, 0.0), "> 0"),
        ((1, 2), (-1.0, 1.0), "> 0"),
        ((1, 2), (1.0, float("nan")), "> 0"),
        ((1, 2.5), (1.0, 1.0), "integers"),
    ],
)
def test_sps_validation_rejects_bad_table(batch_tokens, sps, message):
    with pytest.raises(ValueError, match=message):
        SPSTable(batch_tokens, sps)


def test_sps_from_dict_without_required_keys_raises():
    with pytest.raises(ValueError, match="steps_per_second"):
        SPSTable.from_dict({"batch_tokens": [1]})


def test_sps_from_step_times_rejects_zero_seconds():
    with pytest.raises(ValueError, match="step time"):
        SPSTable.from_step_times([1, 2], [0.1, 0.0])


# ---------------------------------------------------------------------------------------------
# Survival and candidate order
# ---------------------------------------------------------------------------------------------


def test_prefix_survival_is_cumulative_product():
    conf = np.array([[0.5, 0.5, 1.0], [1.0, 0.2, 0.0]])
    np.testing.assert_allclose(prefix_survival(conf), [[0.5, 0.25, 0.25], [1.0, 0.2, 0.0]])


def test_candidate_order_breaks_ties_by_slot_then_request():
    conf = np.ones((2, 2))
    r_idx, j_idx = candidate_order(prefix_survival(conf), np.array([2, 2]))
    assert list(zip(r_idx.tolist(), j_idx.tolist(), strict=True)) == [(0, 1), (1, 1), (0, 2), (1, 2)]


def test_candidate_order_is_prefix_closed_and_skips_zero_survival_and_capped_slots():
    rng = np.random.default_rng(0)
    for _ in range(300):
        n_requests, gamma = int(rng.integers(1, 6)), int(rng.integers(1, 7))
        conf = random_conf(rng, n_requests, gamma, allow_zero=True)
        max_len = rng.integers(0, gamma + 1, size=n_requests)
        survival = prefix_survival(conf)
        r_idx, j_idx = candidate_order(survival, max_len)
        seen = set()
        for r, j in zip(r_idx.tolist(), j_idx.tolist(), strict=True):
            assert j == 1 or (r, j - 1) in seen
            assert j <= max_len[r] and survival[r, j - 1] > 0
            seen.add((r, j))
        assert len(seen) == int(np.sum((survival > 0) & (np.arange(1, gamma + 1) <= max_len[:, None])))


# ---------------------------------------------------------------------------------------------
# Algorithm 1 against brute force
# ---------------------------------------------------------------------------------------------


def brute_force_cases(seed: int, n_cases: int):
    rng = np.random.default_rng(seed)
    for _ in range(n_cases):
        n_requests, gamma = int(rng.integers(1, 4)), int(rng.integers(1, 5))
        conf = random_conf(rng, n_requests, gamma, allow_zero=False)
        max_len = rng.integers(0, gamma + 1, size=n_requests)
        sps = random_table(rng, n_requests * (gamma + 1))
        yield conf, max_len, sps


def test_greedy_path_best_point_equals_exhaustive_optimum():
    for conf, max_len, sps in brute_force_cases(seed=1, n_cases=300):
        best_on_path = max(theta(lengths, conf, sps) for lengths in greedy_path(conf, max_len))
        assert best_on_path == pytest.approx(exhaustive_optimum(conf, max_len, sps), rel=1e-12)


def test_algorithm1_reaches_exhaustive_optimum_whenever_path_is_unimodal():
    unimodal_cases = 0
    for conf, max_len, sps in brute_force_cases(seed=2, n_cases=300):
        values = [theta(lengths, conf, sps) for lengths in greedy_path(conf, max_len)]
        if not is_unimodal(values):
            continue
        unimodal_cases += 1
        lengths = DSpark(sps).schedule(conf, max_len)
        assert theta(lengths, conf, sps) == pytest.approx(exhaustive_optimum(conf, max_len, sps), rel=1e-12)
    assert unimodal_cases >= 100  # the property was exercised, not vacuously true


def test_algorithm1_matches_paper_loop_with_break():
    for conf, max_len, sps in brute_force_cases(seed=3, n_cases=300):
        np.testing.assert_array_equal(
            DSpark(sps).schedule(conf, max_len), reference_algorithm1(conf, max_len, sps)
        )


def test_algorithm1_commits_only_strict_improvements():
    proportional = SPSTable((1,), (1.0,))  # t(B) ∝ B: a draft of survival 1 leaves Θ exactly unchanged
    conf = np.ones((1, 3))
    assert theta(np.array([1]), conf, proportional) == theta(np.array([0]), conf, proportional)
    np.testing.assert_array_equal(DSpark(proportional).schedule(conf, np.array([3])), [0])
    np.testing.assert_array_equal(reference_algorithm1(conf, np.array([3]), proportional), [0])


def test_async_topk_with_fresh_stale_reaches_exhaustive_optimum():
    for conf, max_len, sps in brute_force_cases(seed=4, n_cases=300):
        lengths = DSparkAsync(sps).schedule(conf, max_len, stale_conf=conf)
        assert theta(lengths, conf, sps) == pytest.approx(exhaustive_optimum(conf, max_len, sps), rel=1e-12)


@pytest.mark.parametrize("make_policy", [DSpark, DSparkAsync], ids=["dspark", "dspark-async"])
def test_lengths_respect_max_len_and_gamma_and_skip_zero_survival(make_policy):
    rng = np.random.default_rng(5)
    for _ in range(300):
        n_requests, gamma = int(rng.integers(1, 8)), int(rng.integers(1, 9))
        conf = random_conf(rng, n_requests, gamma, allow_zero=True)
        max_len = rng.integers(0, gamma + 1, size=n_requests)
        stale = random_conf(rng, n_requests, gamma, allow_zero=True)
        lengths = make_policy(random_table(rng, n_requests * (gamma + 1))).schedule(conf, max_len, stale)
        assert lengths.dtype == np.int64 and lengths.shape == (n_requests,)
        assert np.all(lengths >= 0) and np.all(lengths <= max_len) and np.all(max_len <= gamma)
        positive = (prefix_survival(conf) > 0).sum(axis=1)
        assert np.all(lengths <= positive)


# ---------------------------------------------------------------------------------------------
# Prefix order
# ---------------------------------------------------------------------------------------------


def tie_heavy_cases(rng: np.random.Generator):
    yield np.ones((4, 5)), np.array([5, 5, 3, 0])
    yield np.full((3, 4), 0.8), np.array([4, 4, 4])
    yield np.array([[1.0, 1.0, 0.5, 1.0], [0.5, 1.0, 1.0, 0.5], [1.0, 0.5, 1.0, 1.0]]), np.array([4, 4, 4])
    for _ in range(200):
        n_requests, gamma = int(rng.integers(1, 7)), int(rng.integers(1, 8))
        yield (
            random_conf(rng, n_requests, gamma, allow_zero=True),
            rng.integers(0, gamma + 1, size=n_requests),
        )


@pytest.mark.parametrize("make_policy", [DSpark, DSparkAsync], ids=["dspark", "dspark-async"])
def test_admitted_slots_are_a_prefix_of_candidate_order_even_with_ties(make_policy):
    rng = np.random.default_rng(6)
    for conf, max_len in tie_heavy_cases(rng):
        n_requests, gamma = conf.shape
        policy = make_policy(random_table(rng, n_requests * (gamma + 1)))
        lengths = policy.schedule(conf, max_len, stale_conf=conf)
        # ℓ must be exactly the per-request counts of the first Σℓ candidates of the global order,
        # which is prefix-closed (test above): no request ever verifies slot j without slot j-1.
        np.testing.assert_array_equal(lengths, prefix_counts(conf, max_len, int(lengths.sum())))


def test_all_equal_survival_is_shared_round_robin_by_slot():
    sps = SPSTable.from_step_times([1, 16], [1.0, 1.0])  # every token is free up to B = 16
    conf = np.ones((3, 4))
    lengths = DSparkAsync(sps).schedule(conf, np.array([4, 4, 4]))
    np.testing.assert_array_equal(lengths, [4, 4, 4])
    jagged = SPSTable((3, 4, 5, 6), (1.0, 1.2, 1.2, 0.1))  # K = 2: slot 1 of requests 0 and 1
    lengths = DSparkAsync(jagged).schedule(conf, np.array([4, 4, 4]), stale_conf=conf)
    np.testing.assert_array_equal(lengths, [1, 1, 0])


# ---------------------------------------------------------------------------------------------
# Non-anticipation (paper §3.2.2, App. A; digest §5.3–5.4)
# ---------------------------------------------------------------------------------------------

APPENDIX_A_SPS = SPSTable((1, 2, 3), (1.0, 0.5, 0.45))


@pytest.mark.parametrize(("c2", "retrospective_length"), [(0.9, 2), (0.0, 0)])
def test_appendix_a_break_makes_decision_independent_of_c2(c2, retrospective_length):
    conf = np.array([[0.8, c2]])
    max_len = np.array([2])

    def argmax_over_whole_path() -> int:
        values = [theta(np.array([length]), conf, APPENDIX_A_SPS) for length in range(3)]
        return int(np.argmax(values))

    assert argmax_over_whole_path() == retrospective_length  # the biased rule looks at c_2
    np.testing.assert_array_equal(DSpark(APPENDIX_A_SPS).schedule(conf, max_len), [0])


def perturbation_trials(seed: int, n_trials: int):
    """Random case, a request r, a slot k (1-based), and a copy with conf[r, slots k+1..γ] redrawn."""
    rng = np.random.default_rng(seed)
    for _ in range(n_trials):
        n_requests, gamma = int(rng.integers(1, 6)), int(rng.integers(2, 7))
        conf = random_conf(rng, n_requests, gamma, allow_zero=True)
        max_len = rng.integers(0, gamma + 1, size=n_requests)
        stale = random_conf(rng, n_requests, gamma, allow_zero=True)
        stale[rng.random(n_requests) < 0.3] = np.nan
        sps = random_table(rng, n_requests * (gamma + 1))
        r, k = int(rng.integers(n_requests)), int(rng.integers(1, gamma))
        perturbed = conf.copy()
        perturbed[r, k:] = random_conf(rng, 1, gamma - k, allow_zero=True)[0]  # 0-based k: = slots k+1..γ
        yield conf, perturbed, max_len, stale, sps, r, k


@pytest.mark.parametrize("make_policy", [DSpark, DSparkAsync], ids=["dspark", "dspark-async"])
def test_admission_of_slot_k_ignores_confidences_that_depend_on_token_k(make_policy):
    changed = 0
    for conf, perturbed, max_len, stale, sps, r, k in perturbation_trials(seed=7, n_trials=2000):
        policy = make_policy(sps)
        before = policy.schedule(conf, max_len, stale)
        after = policy.schedule(perturbed, max_len, stale)
        assert (before[r] >= k) == (after[r] >= k)
        assert min(before[r], k) == min(after[r], k)  # hence also every slot before k
        changed += int(not np.array_equal(before, after))
    assert changed >= 50  # the perturbation does move the schedule elsewhere


def test_global_argmax_on_current_conf_fails_the_same_check():
    """Negative control: the check above catches the biased rule of App. A."""
    violations = 0
    for conf, perturbed, max_len, _, sps, r, k in perturbation_trials(seed=7, n_trials=2000):
        before, after = (
            retrospective_argmax(conf, max_len, sps),
            retrospective_argmax(perturbed, max_len, sps),
        )
        violations += int((before[r] >= k) != (after[r] >= k))
    assert violations > 0


# ---------------------------------------------------------------------------------------------
# Load awareness and the asynchronous capacity
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make_policy", [DSpark, DSparkAsync], ids=["dspark", "dspark-async"])
def test_mean_length_shrinks_as_concurrency_grows_on_decreasing_sps(make_policy):
    policy = make_policy(linear_table())
    row = np.array([0.9, 0.88, 0.85, 0.8, 0.75, 0.7, 0.6])
    means = []
    for n_requests in (1, 2, 4, 8, 16, 32):
        conf = np.tile(row, (n_requests, 1))
        max_len = np.full(n_requests, row.size)
        means.append(float(policy.schedule(conf, max_len, stale_conf=conf).mean()))
    assert all(later <= earlier for earlier, later in zip(means, means[1:], strict=False)), means
    assert means[-1] < means[0], means


def test_async_escapes_local_optimum_of_jagged_table_where_algorithm1_stops():
    sps = SPSTable.from_step_times([1, 2, 3, 4], [1.0, 2.5, 2.5, 2.5])  # one bucket from B = 2 to 4
    conf = np.full((1, 3), 0.95)
    max_len = np.array([3])
    np.testing.assert_array_equal(DSpark(sps).schedule(conf, max_len), [0])
    np.testing.assert_array_equal(DSparkAsync(sps).schedule(conf, max_len, stale_conf=conf), [3])


def test_async_missing_history_uses_prior_confidence():
    sps = linear_table()
    policy = DSparkAsync(sps, prior=0.6)
    max_len = np.array([7, 7, 5, 7])
    prior_rows = np.full((4, 7), 0.6)
    expected = policy.capacity(prior_rows, max_len)
    assert policy.capacity(None, max_len) == expected
    assert policy.capacity(np.full((4, 7), np.nan), max_len) == expected
    conf = np.full((4, 7), 0.9)
    np.testing.assert_array_equal(policy.schedule(conf, max_len), policy.schedule(conf, max_len, prior_rows))


def test_async_capacity_is_smallest_argmax_and_counts_only_slots_within_max_len():
    flat = SPSTable((1,), (1.0,))  # step time ∝ B: each draft of survival 1 leaves Θ unchanged
    policy = DSparkAsync(flat)
    ones = np.ones((2, 3))
    assert policy.capacity(ones, np.array([3, 3])) == 0
    free = SPSTable.from_step_times([1, 8], [1.0, 1.0])  # tokens free up to B = 8
    assert DSparkAsync(free).capacity(ones, np.array([3, 1])) == 4


def test_async_admits_at_most_current_positive_candidates_when_capacity_is_large():
    free = SPSTable.from_step_times([1, 64], [1.0, 1.0])
    conf = np.array([[0.9, 0.0, 0.9], [0.5, 0.5, 0.5]])
    lengths = DSparkAsync(free).schedule(conf, np.array([3, 2]), stale_conf=np.ones((2, 3)))
    np.testing.assert_array_equal(lengths, [1, 2])


# ---------------------------------------------------------------------------------------------
# Simple policies, input validation and spec parsing
# ---------------------------------------------------------------------------------------------

CONF = np.array([[0.9, 0.8, 0.3, 0.9], [0.2, 0.9, 0.9, 0.9], [0.95, 0.95, 0.95, 0.95]])
MAX_LEN = np.array([4, 4, 2])


def test_off_verifies_nothing():
    np.testing.assert_array_equal(Off().schedule(CONF, MAX_LEN), [0, 0, 0])
    assert Off().name == "off"


def test_static_caps_at_max_len():
    np.testing.assert_array_equal(Static(3).schedule(CONF, MAX_LEN), [3, 3, 2])
    np.testing.assert_array_equal(Static(0).schedule(CONF, MAX_LEN), [0, 0, 0])
    assert Static(3).name == "static:3"


def test_threshold_truncates_at_first_slot_below_threshold():
    np.testing.assert_array_equal(Threshold(0.5).schedule(CONF, MAX_LEN), [2, 0, 2])
    np.testing.assert_array_equal(Threshold(0.9).schedule(CONF, MAX_LEN), [1, 0, 2])
    np.testing.assert_array_equal(Threshold(0.0).schedule(CONF, MAX_LEN), MAX_LEN)
    assert Threshold(0.5).name == "threshold:0.5"


@pytest.mark.parametrize("policy", [Off(), Static(2), Threshold(0.5), DSpark(TABLE), DSparkAsync(TABLE)])
def test_empty_batch_returns_empty_lengths(policy):
    lengths = policy.schedule(np.zeros((0, 4)), np.zeros(0, dtype=np.int64), stale_conf=np.zeros((0, 4)))
    assert lengths.shape == (0,) and lengths.dtype == np.int64


@pytest.mark.parametrize(
    ("conf", "max_len", "stale", "message"),
    [
        (np.array([0.5, 0.5]), np.array([2]), None, r"\[R, γ\]"),
        (np.array([[0.5, 1.5]]), np.array([2]), None, r"\[0, 1\]"),
        (np.array([[0.5, np.nan]]), np.array([2]), None, r"\[0, 1\]"),
        (np.array([[0.5, 0.5]]), np.array([3]), None, "0..γ"),
        (np.array([[0.5, 0.5]]), np.array([1, 1]), None, "shape"),
        (np.array([[0.5, 0.5]]), np.array([1]), np.ones((2, 2)), "stale_conf"),
        (np.array([[0.5, 0.5]]), np.array([1]), np.array([[2.0, 0.5]]), "stale_conf"),
    ],
)
def test_schedule_rejects_malformed_inputs(conf, max_len, stale, message):
    with pytest.raises(ValueError, match=message):
        DSparkAsync(TABLE).schedule(conf, max_len, stale)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("off", Off()),
        ("static:0", Static(0)),
        ("static:3", Static(3)),
        ("threshold:0", Threshold(0.0)),
        ("threshold:0.7", Threshold(0.7)),
        ("threshold:1", Threshold(1.0)),
        ("dspark", DSpark(TABLE)),
        ("dspark-async", DSparkAsync(TABLE)),
    ],
)
def test_policy_for_accepts_valid_specs(spec, expected):
    policy = policy_for(spec, TABLE)
    assert isinstance(policy, Policy)
    assert policy == expected
    assert policy_for(policy.name, TABLE) == policy


@pytest.mark.parametrize(
    "spec",
    [
        "static:abc",
        "static:-1",
        "static:",
        "static:1.5",
        "threshold:1.5",
        "threshold:",
        "threshold:-0.1",
        "threshold:nan",
        "foo",
        "",
        "off:1",
        "dspark:3",
        "static",
    ],
)
def test_policy_for_rejects_malformed_spec_and_lists_valid_forms(spec):
    with pytest.raises(ValueError, match="Valid forms") as info:
        policy_for(spec, TABLE)
    for form in MODES:
        assert form in str(info.value)


@pytest.mark.parametrize("spec", ["dspark", "dspark-async"])
def test_policy_for_needs_sps_table_for_dspark(spec):
    with pytest.raises(ValueError, match="SPS table"):
        policy_for(spec)


@pytest.mark.parametrize(
    "build",
    [
        lambda: Static(-1),
        lambda: Threshold(1.5),
        lambda: DSparkAsync(TABLE, prior=2.0),
        lambda: DSpark(None),
    ],
    ids=["static", "threshold", "async-prior", "dspark-no-table"],
)
def test_policy_constructors_reject_bad_parameters(build):
    with pytest.raises(ValueError):
        build()


def test_skip_drafting_plan_maximises_expected_tokens_per_second():
    """Brute force over every drafting set containing the forced rows: the plan (top-k by
    expected gain) is never worse than drafting all or none, and matches the extremes."""
    import itertools

    from dspark.core.scheduler import DSparkSkip, prefix_survival

    sps = SPSTable.from_step_times([1, 8, 32], [0.010, 0.016, 0.040])
    pol = DSparkSkip(sps)
    rng = np.random.default_rng(0)
    for _ in range(30):
        R = int(rng.integers(1, 6))
        stale = rng.uniform(0.05, 0.98, (R, 7))
        max_len = rng.integers(0, 8, R)
        draft = float(rng.choice([0.0, 0.002, 0.01, 0.05]))
        mask = pol.plan(stale, max_len, draft)
        ell = pol.schedule(stale, max_len)
        gain = np.array([prefix_survival(stale)[r, : ell[r]].sum() for r in range(R)])

        def rate(m, R=R, gain=gain, ell=ell, draft=draft):
            m = np.asarray(m, bool)
            if not m.any():
                return R / sps.step_time(R)
            return (R + gain[m].sum()) / (draft + sps.step_time(R + int(ell[m].sum())))

        assert rate(mask) >= rate(np.ones(R)) - 1e-12 and rate(mask) >= rate(np.zeros(R)) - 1e-12
        best = max(rate(m) for m in itertools.product([0, 1], repeat=R))
        assert rate(mask) >= 0.9 * best
        if draft == 0.0:
            assert mask[gain > 0].all()
    # no history: must draft (nothing to decide on); no measured draft cost yet: everyone drafts
    nan = np.full((2, 7), np.nan)
    assert pol.plan(nan, np.array([7, 7]), 1e9).all()
    assert pol.plan(np.full((2, 7), 0.01), np.array([7, 7]), None).all()
    assert not pol.plan(np.full((2, 7), 0.01), np.array([7, 7]), 1e9).any()
    assert policy_for("dspark-skip", sps).name == "dspark-skip"


def test_skip_plan_prices_the_draft_call_by_its_batch_and_the_steps_measured_now():
    """The vectorised plan equals the plain loop over k (forced + top-k by expected gain) for
    draft costs that depend on the number of drafting requests, catch-up prices and a rescaled
    step-time curve; and it is never worse than any drafting set by more than 10%."""
    from dspark.core.costs import LiveSteps
    from dspark.core.scheduler import DSparkSkip, prefix_survival

    sps = SPSTable.from_step_times([1, 8, 32], [0.010, 0.016, 0.040])
    pol = DSparkSkip(sps)
    rng = np.random.default_rng(1)
    for _ in range(60):
        R = int(rng.integers(1, 7))
        stale = rng.uniform(0.05, 0.98, (R, 7))
        stale[rng.uniform(size=R) < 0.2] = np.nan  # no history: forced
        max_len = rng.integers(0, 8, R)
        a, b = rng.choice([0.0, 0.004, 0.02]), rng.choice([0.0, 0.001, 0.01])

        def draft(n, a=a, b=b):
            return a + b * np.asarray(n, dtype=np.float64)

        catch = rng.uniform(0, 0.004, R)
        forced = rng.uniform(size=R) < 0.2
        live = LiveSteps(sps)
        live.observe(8, float(rng.choice([0.016, 0.040])))
        mask = pol.plan(stale, max_len, draft, forced, catch, live.step_times)

        filled = np.where(np.isnan(stale), pol.prior, stale)
        ell = pol.schedule(filled, max_len)
        gain = np.array([prefix_survival(filled)[r, : ell[r]].sum() for r in range(R)])
        must = forced | np.isnan(stale).all(axis=1)

        def rate(m, R=R, gain=gain, ell=ell, catch=catch, draft=draft, live=live):
            m = np.asarray(m, bool)
            if not m.any():
                return R / live.step_time(R)
            secs = draft(m.sum()) + catch[m].sum() + live.step_time(R + int(ell[m].sum()))
            return (R + gain[m].sum()) / secs

        rest = np.flatnonzero(~must)
        rest = rest[np.argsort(-gain[rest], kind="stable")]
        best, oracle = -1.0, None
        for k in range(len(rest) + 1):  # the plain loop, as it was before vectorising
            m = must.copy()
            m[rest[:k]] = True
            if rate(m) > best:
                best, oracle = rate(m), m
        assert (mask == oracle).all()
        brute = max(rate(must | np.array(m, bool)) for m in itertools.product([0, 1], repeat=R))
        assert rate(mask) >= 0.9 * brute


def test_skip_planner_says_why_a_round_drafts_and_refreshes_only_when_it_could_pay():
    from dspark.core.scheduler import DSparkSkip, SkipPlanner

    sps = SPSTable.from_step_times([1, 64], [0.020, 0.083])  # each verified token costs 1 ms
    planner = SkipPlanner(DSparkSkip(sps))
    poor, poor2, rich, none = np.full(7, 0.05), np.full(7, 0.06), np.full(7, 0.95), np.full(7, np.nan)
    avail = np.full(2, 7)
    # the very first request: no confidence seen at all, it drafts to learn one
    assert planner.choose(1, [0], none[None], avail[:1], 0.005).tolist() == [True]
    assert planner.reason == "new"
    # a new request (1) is judged on the others' confidences: poor, so nobody drafts
    assert not planner.choose(2, [0, 1], np.stack([poor, none]), avail, 0.005).any()
    assert planner.reason is None
    assert planner.choose(3, [0, 1], np.stack([rich, poor]), avail, 0.005)[0]
    assert planner.reason == "merit"
    # round 4 is on the refresh grid: request 1 has not drafted for 2 rounds (≥ 4 / 2) and is due;
    # a stretch like request 0's round 3 would pay, so a refresh could change the decision
    assert planner.choose(4, [0, 1], np.stack([poor2, poor]), avail, 0.005).tolist() == [False, True]
    assert planner.reason == "refresh" and planner.probing
    assert planner.interval(1) == 2 * SkipPlanner.REFRESH  # the refresh did not pay: back off
    # at a price where even the best stretch would not pay, nobody is refreshed (round 8: due)
    assert not planner.choose(8, [0, 1], np.stack([poor2, poor]), avail, 1.0).any()
    assert not planner.probing and planner.reason is None


def test_skip_planner_refreshes_on_a_grid_and_backs_off_while_refreshes_do_not_pay():
    from dspark.core.scheduler import DSparkSkip, SkipPlanner

    sps = SPSTable.from_step_times([1, 64], [0.020, 0.083])
    planner = SkipPlanner(DSparkSkip(sps))
    poor, rich = np.full((1, 7), 0.05), np.full((1, 7), 0.95)
    one = np.full(1, 7)
    planner.choose(1, [9], rich, one, 0.005)  # a request that had a good stretch, then left
    planner.forget(9)
    planner.choose(2, [0], np.full((1, 7), np.nan), one, 0.005)  # judged on the population: drafts
    drafted = [i for i in range(3, 70) if planner.choose(i, [0], poor, one, 0.005)[0]]
    assert drafted == [4, 8, 16, 32, 64]  # the grid of an interval doubling 4 → 8 → ... → 64
    assert planner.interval(0) == planner.max_interval(0.005, 0.02) == 64  # the 0.5% cap


def test_a_new_request_the_population_rejects_still_probes_on_its_first_grid_round():
    """...when the best case would pay at its own catch-up price (its whole prompt)."""
    from dspark.core.scheduler import DSparkSkip, SkipPlanner

    sps = SPSTable.from_step_times([1, 64], [0.020, 0.083])
    poor, rich, none = np.full(7, 0.05), np.full(7, 0.95), np.full(7, np.nan)
    avail = np.full(2, 7)

    def planner_after_three_rounds() -> SkipPlanner:
        planner = SkipPlanner(DSparkSkip(sps))
        planner.choose(1, [9], rich[None], np.full(1, 7), 0.005)  # a good stretch, then gone
        planner.forget(9)
        planner.choose(2, [8], poor[None], np.full(1, 7), 0.005)  # the population is poor now
        assert not planner.choose(3, [8, 0], np.stack([poor, none]), avail, 0.005)[1]  # judged poor
        return planner

    cheap, dear = np.array([0.0, 0.001]), np.array([0.0, 1.0])  # request 0's catch-up price
    planner = planner_after_three_rounds()
    assert planner.choose(4, [8, 0], np.stack([poor, none]), avail, 0.005, cheap)[1]  # first probe
    assert planner.reason == "refresh"
    planner = planner_after_three_rounds()
    assert not planner.choose(4, [8, 0], np.stack([poor, none]), avail, 0.005, dear)[1]


def test_the_probes_of_many_due_requests_equal_judging_each_alone():
    """A refresh round with many requests due judges each at its own catch-up price; the planner
    finds who pays by bisection over the sorted prices, first checking the cheapest (under load
    usually nobody pays: one plan instead of log2(R)). Whatever the prices — none, some or all
    paying — the probes equal judging each new request alone next to the same history."""
    from dspark.core.scheduler import DSparkSkip, SkipPlanner

    sps = SPSTable.from_step_times([1, 64], [0.020, 0.083])
    poor, rich, none = np.full(7, 0.05), np.full(7, 0.95), np.full(7, np.nan)

    def prepared() -> SkipPlanner:
        planner = SkipPlanner(DSparkSkip(sps))
        planner.choose(1, [9], rich[None], np.full(1, 7), 0.005)  # a good stretch, then gone
        planner.forget(9)
        planner.choose(2, [8], poor[None], np.full(1, 7), 0.005)  # the population is poor now
        return planner

    def probes(catch: np.ndarray) -> list[bool]:
        R = len(catch)
        rids, conf, avail = (
            [8, *range(100, 100 + R)],
            np.vstack([poor[None], np.tile(none, (R, 1))]),
            np.full(R + 1, 7),
        )
        planner = prepared()
        assert not planner.choose(3, rids, conf, avail, 0.005)[1:].any()  # judged poor: they wait
        return planner.choose(4, rids, conf, avail, 0.005, np.append(0.0, catch))[1:].tolist()  # due

    rng = np.random.default_rng(3)
    seen = set()
    for scale in (1e-4, 0.003, 0.01, 0.03, 0.1, 1.0):
        catch = rng.uniform(0, scale, 9)
        got = probes(catch)
        assert got == [probes(np.array([c]))[0] for c in catch]
        seen.add((any(got), all(got)))
    assert seen == {(False, False), (True, False), (True, True)}  # nobody, some and everybody paid


def test_sps_sweep_summary_takes_the_median_over_passes_and_fits_it_monotone():
    from dspark.perf.sps import summarise

    def pt(b, us, k):
        return {"batch_tokens": b, "context": 256, "compute_infer_us": us, "pass": k,
                "client_steps_per_second": 1e6 / us, "p50_us": us + 100, "p99_us": us + 200}  # fmt: skip

    points = [pt(1, 20000, 0), pt(2, 30000, 0), pt(3, 26000, 0)]
    points += [pt(1, 22000, 1), pt(2, 90000, 1), pt(3, 28000, 1)]  # an outlier at B = 2
    points += [pt(1, 21000, 2), pt(2, 29000, 2), pt(3, 27000, 2), pt(1, 1, 2) | {"context": 1024}]
    c = summarise(points, 256, [1, 2, 3])
    assert c["measured_steps_per_second"] == pytest.approx([1e6 / 21000, 1e6 / 30000, 1e6 / 27000])
    assert c["steps_per_second"] == pytest.approx([1e6 / 21000, 1e6 / 28500, 1e6 / 28500])  # 2 and 3 pooled
    assert c["p50_us"] == [21100, 30100, 27100]
