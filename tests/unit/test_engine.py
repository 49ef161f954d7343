"""The in-flight batching engine against the reference loop (tiny models)."""

import pytest
import torch

from dspark.block_drafter import BlockDrafterRunner
from dspark.reference import Request, generate
from dspark.sampling import SamplingParams
from dspark.scheduler import SPSTable, parse_policy
from dspark.target import TargetRunner
from orchestrator.engine import Engine
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
    return Engine(TargetRunner(target, slots, 96), BlockDrafterRunner(m, slots, 96), SPS, None, max_active), m


@pytest.mark.parametrize("mode", ["off", "static:3", "dspark", "dspark-async"])
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
            policy=parse_policy(mode),
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
    plain = Engine(TargetRunner(target, 1, 96))
    with pytest.raises(ValueError, match="needs a drafter"):
        plain.submit(_reqs(1)[0], "dspark", Collect())
    assert eng.idle and plain.idle
