"""The GPU probe (dspark.perf.gpu_probe) on device `cpu`: the same code a bare GPU machine runs
(results/gpu-probe/), with the shipped DSpark drafter and a SmolLM2-shaped random target."""

import json

import torch

from dspark.engines import runtimes
from dspark.perf import gpu_probe


def test_probe_on_cpu_reports_equal_greedy_and_a_timing_table(tmp_path):
    argv = ["--device", "cpu", "--out", str(tmp_path), "--prompts", "2", "--max-tokens", "8"]
    argv += ["--sizes", "1,2", "--context", "16", "--reps", "1"]
    assert gpu_probe.main(argv) == 0
    res = json.loads((tmp_path / "gpu_probe.json").read_text())
    for mode in ("off", "static:7", "dspark"):
        m = res["lossless"]["modes"][mode]
        assert m["equal"] and m["tokens"] == 16 and m["slots_free_after"] == [2, 2]
    assert res["lossless"]["modes"]["dspark"]["verified_tokens"] > 0
    assert set(res["timing"]["decode_step_ms"]) == {"1", "2"}
    assert "| static:7 | True |" in (tmp_path / "gpu_probe.md").read_text()


def test_probe_fails_when_the_runtime_is_not_the_target(tmp_path, monkeypatch):
    """A runtime whose target differs (weights perturbed) must be caught: divergences that are not
    near-ties make the probe fail."""
    real = runtimes.torch_target_graph

    def perturbed(model, device="cpu"):
        other = type(model)(model.cfg)
        other.load_state_dict(model.state_dict())
        with torch.no_grad():
            other.lm_head.weight.add_(0.05 * torch.randn_like(other.lm_head.weight))
        return real(other, device)

    monkeypatch.setattr(runtimes, "torch_target_graph", perturbed)
    argv = [
        "--device",
        "cpu",
        "--out",
        str(tmp_path),
        "--prompts",
        "2",
        "--max-tokens",
        "8",
        "--skip",
        "timing",
    ]
    assert gpu_probe.main(argv) == 1
    res = json.loads((tmp_path / "gpu_probe.json").read_text())
    off = res["lossless"]["modes"]["off"]
    assert not off["equal"] and not all(d["near_tie"] for d in off["diverged"])
