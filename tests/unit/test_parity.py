"""The GPU parity gates (engines/parity.py) run device-generic: here ORT (IOBinding) against the
PyTorch runtime on device cpu; a real divergence is reported with the oracle's top-2 gap."""

import json

import pytest
import torch

from dspark.cli import main
from dspark.engines.build import BuildConfig, Builder, build_drafter, build_target, sha256_tensors
from dspark.engines.gpu_build import f32_drafter
from dspark.engines.ort import OrtDrafterRunner, OrtTargetRunner, session
from dspark.engines.parity import NEAR_TIE, graph_parity, greedy_parity, oracle_step_fn, summarize
from dspark.engines.runtimes import OrtGraph, RuntimeSpec, torch_drafter_graphs, torch_target_graph
from tests.conftest import TINY, perturbed_copy
from tests.unit.test_block_drafter import _drafter
from tests.unit.test_engines import _target32


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    target = _target32()
    out = tmp_path_factory.mktemp("parity")
    m = _drafter(kind="dspark", head="markov", target=target)
    b = Builder(out, BuildConfig(buckets=[1, 4], max_context=64, threads=1), log=lambda s: None)
    build_target(b, target, sha256_tensors(target))
    build_drafter(b, m, sha256_tensors(m), {})
    b.write_manifest({})
    return target, m, out, b


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, TINY.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 3)]


def test_graph_gate_passes_for_every_engine_against_its_pytorch_module(built):
    _, _, out, b = built
    reports = {}
    for e in b.engines:
        module, examples, names = b.sources[e["file"]]
        graph = OrtGraph(session(out / e["optimized_file"], 1))
        reports[e["file"]] = graph_parity(graph, module, examples, names, "fp32", e["file"])
    assert all(r["ok"] for r in reports.values()), {k: r["problems"] for k, r in reports.items()}
    assert reports["target.onnx"]["skipped"] == 1  # the S = 0 case: never sent to a plan
    assert summarize(reports, None)["ok"]


def test_a_graph_that_differs_fails_the_gate_naming_the_output(built):
    target, _, out, b = built
    module, examples, names = b.sources["target.onnx"]
    wrong = torch_target_graph(perturbed_copy(target, 0.05).float(), "cpu")
    r = graph_parity(wrong, module, examples, names, "fp32", "target")
    assert not r["ok"] and any("logits" in p for p in r["problems"])


def test_greedy_gate_ort_against_the_torch_runtime_on_cpu(built):
    target, m, out, _ = built
    meta = json.loads((out / "drafter_meta.json").read_text())
    pm = f32_drafter(m)
    ref = (
        OrtTargetRunner(torch_target_graph(target), TINY, 3, 64),
        OrtDrafterRunner(torch_drafter_graphs(pm, meta), meta, 3),
    )
    spec = RuntimeSpec("ort", "cpu", threads=1)
    cand = (
        OrtTargetRunner(OrtGraph(session(out / "target.opt.onnx", 1)), TINY, 3, 64),
        OrtDrafterRunner.open(out, spec, 3),
    )
    oracle = oracle_step_fn(lambda: OrtTargetRunner(torch_target_graph(target), TINY, 1, 64))
    rep = greedy_parity(ref, cand, _prompts(), 16, frozenset({0}), oracle, NEAR_TIE["fp32"])
    assert rep["ok"] and rep["equal"] == rep["total"] == 3


def test_greedy_gate_reports_the_first_divergence_with_the_top2_gap(built):
    target, _, out, _ = built
    other = perturbed_copy(target, 0.3, seed=4).float()
    ref = (OrtTargetRunner(torch_target_graph(target), TINY, 3, 64), None)
    cand = (OrtTargetRunner(torch_target_graph(other), TINY, 3, 64), None)
    oracle = oracle_step_fn(lambda: OrtTargetRunner(torch_target_graph(target), TINY, 1, 64))
    strict = greedy_parity(ref, cand, _prompts(), 16, frozenset(), oracle, 0.0)
    assert not strict["ok"] and strict["equal"] < 3
    div = next(p["first_divergence"] for p in strict["prompts"] if not p["equal"])
    assert div["reference_token"] != div["candidate_token"] and div["reference_top2_gap"] > 0
    assert div["near_tie"] is False
    lenient = greedy_parity(ref, cand, _prompts(), 16, frozenset(), oracle, 1e9)  # every flip a "near-tie"
    assert lenient["ok"]


def test_engines_for_the_gpu_profile_refuse_clearly_without_a_gpu(capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert main(["engines", "--profile", "gpu", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "PROFILE=gpu" in err and ("tensorrt" in err or "GPU" in err)
    assert not (tmp_path / "manifest.json").exists()  # nothing built, nothing claimed
