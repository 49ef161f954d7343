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


def test_the_greedy_gate_passes_ort_against_the_torch_runtime_on_real_prompts(built):
    """The GPU build's greedy gate (engines/parity.py), run on the CPU: SmolLM2 + the shipped
    drafter on ONNX Runtime (IOBinding, slots on the device) against the torch runtime."""
    import copy

    from dspark.engines.gpu_build import f32_drafter
    from dspark.engines.parity import NEAR_TIE, greedy_parity, oracle_step_fn
    from dspark.engines.runtimes import RuntimeSpec, torch_drafter_graphs, torch_target_graph
    from dspark.training.pipeline import load_drafter

    loaded, out = built
    meta = json.loads((out / "drafter_meta.json").read_text())
    drafter, _ = load_drafter("dspark", loaded)
    cfg = loaded.model.cfg
    target_graph = torch_target_graph(copy.deepcopy(loaded.model))
    reference = (
        OrtTargetRunner(target_graph, cfg, 3, 1024),
        OrtDrafterRunner(torch_drafter_graphs(f32_drafter(drafter), meta), meta, 3),
    )
    candidate = (
        OrtTargetRunner(session(out / "target.opt.onnx", 2), cfg, 3, 1024),
        OrtDrafterRunner.open(out, RuntimeSpec(threads=2), 3),
    )
    prompts = [loaded.chat_ids(eval_prompts(name, 1)[0]) for name in ("gsm8k-test", "humaneval", "mt-bench")]
    oracle = oracle_step_fn(lambda: OrtTargetRunner(target_graph, cfg, 1, 1024))
    report = greedy_parity(reference, candidate, prompts, 32, loaded.stop_ids, oracle, NEAR_TIE["fp32"])
    assert report["ok"], report
    assert report["equal"] == 3, report  # fp32 on the same CPU: no near-tie flips either
