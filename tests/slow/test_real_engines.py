"""Engines for the real target and the shipped DSpark drafter (issue 4's end-to-end gate)."""

import json

import pytest

from dspark.core.interfaces import Request
from dspark.core.reference import generate
from dspark.core.scheduler import policy_for
from dspark.core.sps import SPSTable
from dspark.engines.ort import OrtDrafterRunner, OrtTargetRunner, session
from dspark.models.target import TargetRunner
from dspark.prompts import eval_prompts


@pytest.fixture(scope="module")
def built(real_engines):
    return real_engines


def test_real_engines_pass_their_gates(built):
    _, out = built
    man = json.loads((out / "manifest.json").read_text())
    assert {e["role"] for e in man["engines"]} == {
        "target",
        "drafter_context",
        "drafter_backbone",
        "drafter_head",
    }
    for e in man["engines"]:
        assert e["verified"]["max_abs_diff_vs_pytorch"] <= 1e-3


def test_greedy_through_onnx_engines_equals_the_pytorch_target_on_eval_prompts(built):
    """ORT target + ORT drafter graphs in the reference loop vs PyTorch target-only greedy."""
    loaded, out = built
    prompts = [eval_prompts(name, 1)[0] for name in ("gsm8k-test", "humaneval", "mt-bench")]
    reqs = [Request(loaded.chat_ids(p), max_tokens=48, stop_ids=loaded.stop_ids) for p in prompts]
    plain = generate(TargetRunner(loaded.model, 3, 1024), reqs)
    sps = SPSTable.from_step_times([1, 32], [1.0, 2.0])
    ort_t = OrtTargetRunner(session(out / "target.opt.onnx", 2), loaded.model.cfg, 3, 1024)
    drafter = OrtDrafterRunner.load(out, num_slots=3, threads=2)
    spec = generate(ort_t, reqs, drafter=drafter, policy=policy_for("static:7", sps))
    assert [r.tokens for r in spec] == [r.tokens for r in plain]
    assert sum(r.stats.accepted_tokens for r in spec) > 0, "the shipped drafter accepted nothing"
    assert drafter.free_slots == 3 and ort_t.cache.free_slots == 3
