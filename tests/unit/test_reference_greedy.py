"""The reference loop's greedy output equals target-only greedy decoding, token for token."""

import pytest
import torch

from dspark.core.calibration import STS
from dspark.core.interfaces import Request
from dspark.core.reference import generate
from dspark.core.sampling import SamplingParams
from dspark.core.scheduler import policy_for
from dspark.core.sps import SPSTable
from dspark.models.model_drafter import ModelDrafter
from dspark.models.target import TargetRunner
from tests.conftest import TINY, perturbed_copy, tiny_target

GAMMA = 7
# a CPU-like curve: a step costs 10 ms + 1.5 ms per batch token
SPS = SPSTable.from_step_times(list(range(1, 129)), [0.010 + 0.0015 * b for b in range(1, 129)])
POLICIES = ["off", "static:1", "static:7", "threshold:0.6", "dspark", "dspark-async"]


def _greedy_by_full_recompute(model, prompt: list[int], n: int, stop: int) -> list[int]:
    """Independent oracle: re-run the whole sequence every token, no KV cache, argmax."""
    seq, out = list(prompt), []
    for _ in range(n):
        runner = TargetRunner(model, 1, 256)
        logits = runner.step([runner.allocate()], [seq]).logits[0, -1]
        tok = int(logits.argmax())
        out.append(tok)
        seq.append(tok)
        if tok == stop:
            break
    return out


@pytest.fixture(scope="module")
def models():
    target = tiny_target(seed=3)
    return target, perturbed_copy(target, scale=0.03, seed=4)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(11)
    lengths = [3, 9, 1, 17, 6]
    return [torch.randint(1, TINY.vocab_size, (n,), generator=g).tolist() for n in lengths]


def _requests(prompts, max_tokens=24):
    return [Request(p, max_tokens=max_tokens + i, stop_ids=frozenset({0})) for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def target_only(models, prompts):
    target, _ = models
    return [r.tokens for r in generate(TargetRunner(target, 8, 128), _requests(prompts))]


def test_target_only_loop_equals_full_recompute_greedy(models, prompts, target_only):
    target, _ = models
    for p, got, req in zip(prompts, target_only, _requests(prompts)):
        assert got == _greedy_by_full_recompute(target, p, req.max_tokens, stop=0)


@pytest.mark.parametrize("mode", POLICIES)
def test_greedy_output_equals_target_greedy_under_every_policy(models, prompts, target_only, mode):
    target, draft = models
    results = generate(
        TargetRunner(target, 8, 128),
        _requests(prompts),
        drafter=ModelDrafter(draft, block_size=GAMMA, num_slots=8, max_len=128),
        policy=policy_for(mode, SPS),
        calibration=STS.identity(GAMMA),
    )
    assert [r.tokens for r in results] == target_only
    if mode != "off":
        accepted = sum(r.stats.accepted_tokens for r in results)
        verified = sum(r.stats.verified_tokens for r in results)
        assert 0 < accepted, "no draft was accepted: the test would not exercise acceptance"
        if mode == "static:7":
            assert accepted < verified, "no draft was rejected: the test would not exercise corrections"


def test_drafter_identical_to_target_accepts_every_verified_draft(models, prompts, target_only):
    target, _ = models
    results = generate(
        TargetRunner(target, 8, 128),
        _requests(prompts),
        drafter=ModelDrafter(target, block_size=GAMMA, num_slots=8, max_len=128),
        policy=policy_for("static:7"),
    )
    assert [r.tokens for r in results] == target_only
    for r in results:
        assert r.stats.accepted_tokens == r.stats.verified_tokens


def test_slots_are_released_after_generation(models, prompts):
    target, draft = models
    runner = TargetRunner(target, 5, 128)
    drafter = ModelDrafter(draft, block_size=GAMMA, num_slots=5, max_len=128)
    for _ in range(2):  # a second batch needs the same 5 slots again
        generate(runner, _requests(prompts), drafter=drafter, policy=policy_for("dspark", SPS))
    assert runner.cache.free_slots == 5 and drafter.runner.cache.free_slots == 5


def test_sampled_output_is_reproducible_from_the_seed_alone(models, prompts):
    target, draft = models
    reqs = [
        Request(p, max_tokens=12, params=SamplingParams(temperature=1.0, seed=100 + i))
        for i, p in enumerate(prompts)
    ]

    def run(batch):
        return [
            r.tokens
            for r in generate(
                TargetRunner(target, 8, 128),
                batch,
                drafter=ModelDrafter(draft, block_size=GAMMA, num_slots=8, max_len=128),
                policy=policy_for("static:3"),
            )
        ]

    together = run(reqs)
    alone = [run([r])[0] for r in reqs[:2]]
    assert together[:2] == alone


def test_slots_are_released_when_generation_fails(models, prompts):
    target, draft = models
    runner = TargetRunner(target, 5, 32)
    drafter = ModelDrafter(draft, block_size=GAMMA, num_slots=5, max_len=32)
    too_long = _requests(prompts[:2]) + [Request(list(range(1, 40)), max_tokens=4)]
    with pytest.raises(ValueError, match="exceed the KV cache length"):
        generate(runner, too_long, drafter=drafter, policy=policy_for("static:3"))
    with pytest.raises(RuntimeError, match="KV slots are in use"):
        generate(
            runner,
            _requests(prompts) + _requests(prompts[:1]),
            drafter=drafter,
            policy=policy_for("static:3"),
        )
    assert runner.cache.free_slots == 5 and drafter.runner.cache.free_slots == 5
