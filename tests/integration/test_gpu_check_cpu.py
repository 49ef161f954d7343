"""`dspark gpu-check` runs its phases without a GPU when told to (device cpu, cpu profile): env,
an SPS sweep through a real tritonserver, the summary; phases it skips say why. On a machine
without a GPU the gpu profile refuses at the env phase with exit 2."""

import json

import pytest
import torch

from dspark.cli import main
from tests.unit.test_engines import _build, _target32

pytestmark = pytest.mark.integration


def test_the_gpu_check_driver_runs_on_the_cpu_and_writes_its_results(tmp_path):
    eng = tmp_path / "engines"
    _build(eng, "markov", _target32())
    out = tmp_path / "results"
    argv = ["gpu-check", "--device", "cpu", "--profile", "cpu", "--runtime", "ort", "--engines", str(eng),
            "--skip", "build,bench", "--sizes", "1,2", "--out", str(out), "--threads", "1"]  # fmt: skip
    assert main(argv) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["phases"]["env"]["status"] == "ok" and "onnxruntime" in s["phases"]["env"]
    assert s["phases"]["build"] == {"status": "skipped", "why": "--skip"} | {}
    assert s["phases"]["sps"]["status"] == "ok", s["phases"]["sps"]
    sps = json.loads((out / "sps.json").read_text())
    assert sps["batch_tokens"] == [1, 2] and all(v > 0 for v in sps["steps_per_second"])
    md = (out / "summary.md").read_text()
    assert "| sps | ok |" in md and "| bench | skipped |" in md and "SPS(B): B=1" in md
    if not torch.cuda.is_available():
        assert main(["gpu-check", "--engines", str(eng), "--out", str(tmp_path / "gpu")]) == 2
        env = json.loads((tmp_path / "gpu" / "phase-env.json").read_text())
        assert env["status"] == "failed" and ("GPU" in env["error"] or "CPU-only" in env["error"])
