"""The in-flight batching engine against the reference loop (tiny models)."""

import numpy as np
import pytest
import torch

from dspark.core.interfaces import Request
from dspark.core.reference import generate
from dspark.core.sampling import SamplingParams
from dspark.core.scheduler import SkipPlanner, policy_for
from dspark.core.sps import SPSTable
from dspark.models.block_drafter import BlockDrafterRunner
from dspark.models.target import TargetRunner
from dspark.orchestrator.batcher import Batcher, Busy
from tests.conftest import TINY, tiny_target
from tests.unit.test_block_drafter import _drafter

SPS = SPSTable.from_step_times([1, 64], [1.0, 1.0 + 0.05 * 63])


class Collect:
    def __init__(self):
        self.out, self.result, self.err, self.calls = [], None, None, 0

    def tokens(self, t):
        self.calls += 1
        self.out += t

    def done(self, r):
        assert self.result is None and self.err is None
        self.result = r

    def error(self, m):
        assert self.result is None and self.err is None
        self.err = m


def _reqs(n, params=lambda i: SamplingParams(), max_tokens=20):
    g = torch.Generator().manual_seed(3)
    return [
        Request(
            torch.randint(1, TINY.vocab_size, (3 + 2 * i,), generator=g).tolist(),
            max_tokens=max_tokens + i,
            params=params(i),
            stop_ids=frozenset({0}),
        )
        for i in range(n)
    ]


def _engine(target, slots=3, max_active=3):
    m = _drafter(target=target)
    return Batcher(
        TargetRunner(target, slots, 96), BlockDrafterRunner(m, slots, 96), SPS, None, max_active
    ), m


@pytest.mark.parametrize("mode", ["off", "static:3", "dspark", "dspark-async", "dspark-skip"])
def test_staggered_admission_gives_the_target_alone_greedy_tokens(mode):
    target = tiny_target()
    reqs = _reqs(6)
    plain = [r.tokens for r in generate(TargetRunner(target, 6, 96), reqs)]
    eng, _ = _engine(target, slots=2, max_active=2)  # 6 requests through 2 slots: queueing
    sinks = [Collect() for _ in reqs]
    eng.submit(reqs[0], mode, sinks[0])
    eng.step()
    for r, s in zip(reqs[1:], sinks[1:]):
        eng.submit(r, mode, s)
    eng.run_until_idle(500)
    assert [s.out for s in sinks] == plain
    assert all(s.result is not None and s.result.tokens == s.out for s in sinks)
    assert eng.target.cache.free_slots == 2 and eng.drafter.free_slots == 2


def test_a_sampled_request_draws_the_same_tokens_alone_or_in_any_company():
    target = tiny_target()
    reqs = _reqs(5, params=lambda i: SamplingParams(1.0, seed=40 + i))
    eng, m = _engine(target, slots=3, max_active=3)
    modes = ["static:3", "off", "static:3", "static:3", "off"]
    sinks = [Collect() for _ in reqs]
    for r, mode, s in zip(reqs, modes, sinks):
        eng.submit(r, mode, s)
        eng.step()
    eng.run_until_idle(500)
    for r, mode, s in zip(reqs, modes, sinks):
        alone = generate(
            TargetRunner(target, 1, 96),
            [r],
            drafter=BlockDrafterRunner(m, 1, 96) if mode != "off" else None,
            policy=policy_for(mode),
        )[0]
        assert s.out == alone.tokens
    assert sum(s.calls for s in sinks) > len(sinks)  # tokens were streamed in pieces


def test_cancel_releases_slots_and_the_others_finish():
    target = tiny_target()
    reqs = _reqs(3, max_tokens=30)
    eng, _ = _engine(target)
    sinks = [Collect() for _ in reqs]
    rids = [eng.submit(r, "static:3", s) for r, s in zip(reqs, sinks)]
    eng.step()
    eng.step()
    assert eng.cancel(rids[1])
    eng.run_until_idle(500)
    assert sinks[1].err == "cancelled" and sinks[1].result is None
    assert sinks[0].result is not None and sinks[2].result is not None
    assert eng.target.cache.free_slots == 3 and eng.drafter.free_slots == 3
    assert not eng.cancel(12345)


def test_a_failing_request_gets_an_error_and_the_server_keeps_serving():
    target = tiny_target()
    eng, _ = _engine(target)
    good, bad = Collect(), Collect()
    eng.submit(Request(list(range(1, 120)), max_tokens=4), "static:3", bad)  # longer than the 96-slot cache
    eng.run_until_idle(50)
    assert bad.err and "96" in bad.err
    eng.submit(_reqs(1)[0], "dspark", good)
    eng.run_until_idle(200)
    assert good.result is not None and good.err is None
    assert eng.target.cache.free_slots == 3 and eng.drafter.free_slots == 3


def test_modes_are_validated_at_submit():
    target = tiny_target()
    eng, _ = _engine(target)
    with pytest.raises(ValueError, match="static"):
        eng.submit(_reqs(1)[0], "static:x", Collect())
    plain = Batcher(TargetRunner(target, 1, 96))
    with pytest.raises(ValueError, match="needs a drafter"):
        plain.submit(_reqs(1)[0], "dspark", Collect())
    assert eng.idle and plain.idle


class _Flaky:
    """A drafter that works for `ok` calls of `method`, then raises on every call to it."""

    def __init__(self, inner, method, ok):
        self.inner, self.method, self.ok = inner, method, ok
        self.block_size = inner.block_size

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name != self.method:
            return attr

        def flaky(*a, **k):
            if self.ok <= 0:
                raise RuntimeError("drafter_backbone is not loaded")
            self.ok -= 1
            return attr(*a, **k)

        return flaky


@pytest.mark.parametrize("method, ok", [("propose", 2), ("advance", 3), ("begin", 0)])
def test_a_failing_drafter_falls_back_to_target_only_with_the_same_tokens(method, ok):
    target = tiny_target()
    reqs = _reqs(3, max_tokens=24)
    plain = [r.tokens for r in generate(TargetRunner(target, 3, 96), reqs)]
    m = _drafter(target=target)
    inner = BlockDrafterRunner(m, 3, 96)
    eng = Batcher(TargetRunner(target, 3, 96), _Flaky(inner, method, ok), SPS, None, 3, drafter_retry_s=60)
    sinks = [Collect() for _ in reqs]
    for r, s in zip(reqs, sinks):
        eng.submit(r, "dspark", s)
    eng.run_until_idle(500)
    assert [s.out for s in sinks] == plain
    assert all(s.result.fallback and "drafter" in s.result.fallback for s in sinks)
    met = eng.metrics
    assert met.gauge("drafter_available") == 0.0
    assert sum(v for k, v in met.snapshot()["counters"].items() if k.startswith("fallback_events_total")) >= 3
    assert eng.target.cache.free_slots == 3 and inner.free_slots == 3
    # while the drafter is marked down, new requests are admitted target-only straight away
    late = Collect()
    eng.submit(reqs[0], "dspark", late)
    eng.run_until_idle(500)
    assert late.out == plain[0] and late.result.fallback == "drafter unavailable at admission"


def test_the_drafter_is_retried_after_drafter_retry_s():
    target = tiny_target()
    req = _reqs(1, max_tokens=16)[0]
    m = _drafter(target=target)
    flaky = _Flaky(BlockDrafterRunner(m, 2, 96), "propose", 0)
    eng = Batcher(TargetRunner(target, 2, 96), flaky, SPS, None, 2, drafter_retry_s=0.0)
    first, second = Collect(), Collect()
    eng.submit(req, "static:3", first)
    eng.run_until_idle(200)
    assert first.result.fallback is not None
    flaky.ok = 10**6  # the drafter is back
    eng.submit(req, "static:3", second)
    eng.run_until_idle(200)
    assert second.out == first.out and second.result.fallback is None
    assert second.result.stats.rounds < first.result.stats.rounds or len(second.out) <= 2
    assert eng.metrics.gauge("drafter_available") == 1.0


def test_a_full_queue_answers_busy_and_keeps_the_queued():
    target = tiny_target()
    m = _drafter(target=target)
    eng = Batcher(TargetRunner(target, 1, 96), BlockDrafterRunner(m, 1, 96), SPS, None, 1, max_queue=2)
    reqs = _reqs(4, max_tokens=6)
    sinks = [Collect() for _ in reqs]
    for r, s in zip(reqs[:3], sinks):
        eng.submit(r, "static:2", s)
    with pytest.raises(Busy, match="max_queue 2"):
        eng.submit(reqs[3], "static:2", sinks[3])
    eng.run_until_idle(500)
    assert all(s.result is not None for s in sinks[:3])
    assert eng.metrics.counter("requests_total", outcome="busy") == 1
    assert eng.metrics.counter("requests_total", outcome="finished") == 3


def test_metrics_count_every_verified_and_accepted_draft():
    target = tiny_target()
    eng, _ = _engine(target)
    reqs = _reqs(3)
    sinks = [Collect() for _ in reqs]
    for r, s in zip(reqs, sinks):
        eng.submit(r, "static:3", s)
    eng.run_until_idle(500)
    met, snap = eng.metrics, eng.metrics.snapshot()
    rounds = [t for s in sinks for t in s.result.trace]
    for k in (1, 2, 3):
        assert met.counter("position_verified_total", position=str(k)) == sum(t.verified >= k for t in rounds)
        assert met.counter("position_accepted_total", position=str(k)) == sum(t.accepted >= k for t in rounds)
    assert snap["histograms"]["verify_length"]["count"] == len(rounds)
    assert snap["histograms"]["acceptance_length"]["sum"] == sum(t.accepted for t in rounds)
    assert met.counter("generated_tokens_total") == sum(len(s.out) for s in sinks)
    assert met.gauge("active_sequences") == 0 and met.gauge("free_slots") == 3
    cal = met.calibration()
    assert cal["positions"] == [1, 2, 3] and all(0 <= p <= 1 for p in cal["predicted"])
    verified = [t for t in rounds if t.verified >= 1]
    assert cal["realized"][0] == pytest.approx(sum(t.accepted >= 1 for t in verified) / len(verified))


class _FixedPrice:
    """A draft call's price held fixed whatever is measured (the plan's input under test)."""

    seen = True

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def observe(self, n, seconds) -> None:
        pass

    def __call__(self, n):
        return np.full(np.shape(n), self.seconds)


def test_dspark_skip_decodes_the_same_tokens_whether_it_drafts_or_not():
    """A free draft round: only requests whose scheduled ℓ would be 0 skip; a prohibitive one:
    only requests without history (first round) or due for a refresh draft; the tokens are
    the target's either way."""
    target = tiny_target()
    reqs = _reqs(3, max_tokens=30)
    plain = [r.tokens for r in generate(TargetRunner(target, 3, 96), reqs)]
    skipped = {}
    for draft_seconds in (0.0, 1e6):
        eng, _ = _engine(target)
        sinks = [Collect() for _ in reqs]
        for r, s in zip(reqs, sinks):
            eng.submit(r, "dspark-skip", s)
        eng.step()  # the first round drafts (no confidences yet) and measures the draft cost
        eng.draft_cost = _FixedPrice(draft_seconds)
        eng.run_until_idle(500)
        assert [s.out for s in sinks] == plain
        skipped[draft_seconds] = eng.metrics.counter("skipped_drafts_total")
        drafted_rounds = sum(len(s.result.trace) for s in sinks)
        all_rounds = sum(s.result.stats.rounds for s in sinks)
        assert drafted_rounds + skipped[draft_seconds] == all_rounds
        if draft_seconds > 0:
            assert drafted_rounds <= 6 + all_rounds / SkipPlanner.REFRESH
        # every round with a draft call is counted once, with why; the target steps were timed
        reasons = {r: eng.metrics.counter("draft_rounds_total", reason=r) for r in SkipPlanner.REASONS}
        assert reasons["new"] == 1  # the first round: nobody has confidences yet
        if draft_seconds > 0:  # not even the best stretch could pay: no refresh either
            assert reasons["merit"] == 0 and reasons["refresh"] == 0
        else:
            assert reasons["merit"] >= 1
        assert eng.live.observed > 0 and eng.live.scale > 0
    assert skipped[0.0] < skipped[1e6]


def test_dspark_skip_stops_refreshing_when_no_refresh_could_pay_and_resumes_when_drafting_pays():
    target = tiny_target()
    req = Request([5, 6, 7], max_tokens=80, stop_ids=frozenset())
    plain = generate(TargetRunner(target, 1, 96), [req])[0].tokens
    eng, _ = _engine(target)
    sink = Collect()
    eng.submit(req, "dspark-skip", sink)
    eng.step()  # first round: drafts (no confidences yet)
    eng.draft_cost = _FixedPrice(1e6)  # drafting can never pay, not even a refresh
    for _ in range(40):
        eng.step()
    seq = eng.active[0].seq
    assert len(seq.trace) == 1 and not eng.planner("dspark-skip").probing
    eng.draft_cost = _FixedPrice(0.0)  # a free draft call: drafting pays again
    eng.run_until_idle(200)
    assert len(sink.result.trace) > 1
    assert sink.out == plain


def test_prefill_budget_staggers_admission_and_keeps_the_tokens():
    """Prompts of 3, 5, 7, 9, 11 tokens with a budget of 8 prompt tokens per step: the first
    step admits 3 + 5, then 7 alone, then 9 alone (a prompt above the budget is still admitted
    when it is the step's first); budget 0 admits everything at once. Same tokens either way."""
    target = tiny_target()
    reqs = _reqs(5, max_tokens=6)
    plain = [r.tokens for r in generate(TargetRunner(target, 5, 96), reqs)]
    for budget, admitted in ((8, [2, 3, 4]), (0, [5, 5, 5])):
        eng = Batcher(TargetRunner(target, 5, 96), None, None, None, 5, prefill_budget=budget)
        sinks = [Collect() for _ in reqs]
        for r, s in zip(reqs, sinks):
            eng.submit(r, "off", s)
        seen = []
        for _ in range(3):
            eng.step()
            seen.append(len(eng.active) + sum(s.result is not None for s in sinks))
        assert seen == admitted
        eng.run_until_idle(100)
        assert [s.out for s in sinks] == plain


def test_dspark_skip_reports_each_drafting_rounds_return_to_its_planner():
    """The batcher measures what every dspark-skip drafting round returned (accepted drafts) and
    cost beyond a plain round, and hands both to the planner (the refresh throttle's input)."""
    target = tiny_target()
    eng, _ = _engine(target)
    eng.draft_cost = _FixedPrice(0.0)
    sink = Collect()
    eng.submit(Request([5, 6, 7], max_tokens=40, stop_ids=frozenset()), "dspark-skip", sink)
    eng.run_until_idle(200)
    value = [v for window in eng.planner("dspark-skip")._value.values() for v in window]
    drafted = sum(1 for t in sink.result.trace if t.verified > 0)
    assert 0 < len(value) <= len(sink.result.trace) and drafted > 0
    assert all(b >= 0 and c >= 0 for b, c in value)
    accepted = sum(t.accepted for t in sink.result.trace)
    assert (sum(b for b, _ in value) > 0) == (accepted > 0)
