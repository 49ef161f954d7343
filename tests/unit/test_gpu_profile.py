"""The gpu profile's repository and the python models' runtimes (issue 13), without a server:
the repository renders python models on KIND_GPU and validates against Triton's proto with every
file its runtime loads present, or a clear error naming the missing ones; the services built from
the models' parameters (as Triton builds them) run the ort and torch runtimes on device cpu
through the orchestrator, whose BLS byte count matches what crossed; CUDA / TensorRT refuse
clearly where they are absent."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from dspark.core.reference import generate
from dspark.engines.build import BuildConfig, Builder, build_drafter, build_target, sha256_tensors
from dspark.engines.runtimes import RuntimeUnavailable
from dspark.engines.tensorrt import plan_file
from dspark.model_repository.render import RenderError, render, validate
from dspark.model_repository.services import make_service
from dspark.models.target import TargetRunner
from dspark.orchestrator.runtime import bls_bytes, make_orchestrator
from tests.conftest import TINY
from tests.unit.test_block_drafter import _drafter
from tests.unit.test_engines import _target32
from tests.unit.test_serving import Sender, _inputs, _wait


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Tiny engines whose drafter_meta names a drafter checkpoint, and a target checkpoint
    directory: what the torch runtime loads."""
    target = _target32()
    root = tmp_path_factory.mktemp("gpu-profile")
    ckpt = root / "target"
    ckpt.mkdir()
    state = {k: v.contiguous() for k, v in target.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(ckpt / "model.safetensors"))
    (ckpt / "dspark_target.json").write_text(json.dumps(TINY.to_dict()))
    m = _drafter(kind="dspark", head="rnn", target=target)
    m.save(root / "drafter")
    eng = root / "engines"
    b = Builder(eng, BuildConfig(buckets=[1, 4], max_context=64, threads=1), log=lambda s: None)
    build_target(b, target, sha256_tensors(target))
    build_drafter(b, m, sha256_tensors(m), {"drafter": str(root / "drafter")})
    b.write_manifest({})
    return target, eng, ckpt


MODELS = {"target", "drafter_backbone", "drafter_head", "dspark"}


@pytest.fixture(autouse=True)
def _torch_threads():
    """make_service sets torch's threads for its process (1 on the CPU): restore them here."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_gpu_repository_is_python_models_on_kind_gpu_and_names_missing_plans(built, tmp_path):
    _, eng, _ = built
    repo = tmp_path / "gpu"
    assert set(render("gpu", repo, eng, None, num_slots=4, max_len=64)) == MODELS
    with pytest.raises(RenderError, match=r"target \(runtime tensorrt\).*target\.fp32\.plan.*PROFILE=gpu"):
        validate(repo)
    cfgs = validate(repo, require_files=False)  # the configs themselves parse against the proto
    assert all(c.backend == "python" and not c.platform for c in cfgs.values())
    for m in ("target", "drafter_backbone", "drafter_head"):
        assert [g.kind for g in cfgs[m].instance_group] == [cfgs[m].instance_group[0].KIND_GPU]
        p = {k: v.string_value for k, v in cfgs[m].parameters.items()}
        assert (p["runtime"], p["device"], p["precision"]) == ("tensorrt", "cuda", "fp32")
    assert cfgs["dspark"].instance_group[0].kind == cfgs["dspark"].instance_group[0].KIND_CPU
    meta = json.loads((eng / "drafter_meta.json").read_text())
    plans = ["target.onnx", "drafter_context.onnx"] + [
        f.replace(".opt.onnx", ".onnx")
        for r in ("drafter_backbone", "drafter_head")
        for f in meta["files"][r].values()
    ]
    for f in plans[:-1]:
        (eng / plan_file(f, "fp32")).write_bytes(b"plan")
    with pytest.raises(RenderError, match=r"drafter_head.*drafter_head\.b4\.fp32\.plan"):
        validate(repo)  # the last head plan is still missing: named, never skipped
    (eng / plan_file(plans[-1], "fp32")).write_bytes(b"plan")
    assert set(validate(repo)) == MODELS
    for f in plans:
        (eng / plan_file(f, "fp32")).unlink()


def test_gpu_profile_with_the_cuda_provider_or_torch_needs_other_files(built, tmp_path):
    _, eng, ckpt = built
    render("gpu", tmp_path / "ort", eng, None, num_slots=2, max_len=64, runtime="ort", device="cuda:1")
    cfgs = validate(tmp_path / "ort")  # the exported .onnx files are there
    assert list(cfgs["target"].instance_group[0].gpus) == [1]
    render("gpu", tmp_path / "pt", eng, None, num_slots=2, max_len=64, runtime="torch")
    with pytest.raises(RenderError, match="no target_dir"):
        validate(tmp_path / "pt")
    render("gpu", tmp_path / "pt", eng, ckpt, num_slots=2, max_len=64, runtime="torch")
    assert set(validate(tmp_path / "pt")) == MODELS
    with pytest.raises(RenderError, match="runs on a GPU"):
        render("gpu", tmp_path / "x", eng, None, device="cpu")
    with pytest.raises(RenderError, match="does not"):
        render("gpu", tmp_path / "x", eng, None, runtime="ort", device="cpu")
    with pytest.raises(RenderError, match="does not"):
        render("cpu", tmp_path / "x", eng, None, device="cuda")
    with pytest.raises(RenderError, match="outputs"):
        render("cpu", tmp_path / "x", eng, None, outputs="device")
    cpu = validate(tmp_path / "cpu") if render("cpu", tmp_path / "cpu", eng, None) else None
    assert {c.instance_group[0].kind for c in cpu.values()} == {cpu["dspark"].instance_group[0].KIND_CPU}


def _params(eng, ckpt, runtime, service):
    return {
        "service": service, "engines_dir": str(eng), "target_dir": str(ckpt), "num_slots": "3",
        "max_len": "64", "threads": "1", "runtime": runtime, "device": "cpu", "providers": "",
        "precision": "fp32", "outputs": "host", "tf32": "0",
    }  # fmt: skip


@pytest.mark.parametrize("runtime", ["ort", "torch"])
def test_the_python_models_services_on_each_runtime_serve_the_target_alone(built, runtime):
    """make_service as the Triton models call it, the orchestrator over them (in-process BLS):
    greedy tokens equal the target alone; the BLS byte counter equals the bytes that crossed."""
    target, eng, ckpt = built
    services = {
        s: make_service(_params(eng, ckpt, runtime, s))
        for s in ("target", "drafter_backbone", "drafter_head")
    }
    crossed = {}

    def call(model, inputs, outputs):
        res = services[model].handle(inputs)
        res = {k: res[k] for k in outputs}
        if "probe_tokens" in inputs:  # the startup SPS probe goes around the timed transport
            return res
        acc = crossed.setdefault(model, [0, 0])
        acc[0] += sum(np.asarray(v).nbytes for v in inputs.values())
        acc[1] += sum(np.asarray(v).nbytes for v in res.values())
        return res

    params = {
        "engines_dir": str(eng),
        "num_slots": "3",
        "max_len": "64",
        "sps_path": "",
        "default_mode": "dspark",
    }
    orch = make_orchestrator(params, call).start()
    prompts = [[5, 9, 2, 7], [3, 1, 4, 1, 5, 9, 2, 6], [8]]
    senders = [Sender() for _ in prompts]
    try:
        for p, s in zip(prompts, senders):
            orch.submit(_inputs(p, max_tokens=12, mode=np.array([b"dspark"], object)), s)
        _wait(*senders)
    finally:
        orch.stop()
    from dspark.core.interfaces import Request

    want = generate(
        TargetRunner(target, 3, 64), [Request(p, 12, stop_ids=frozenset(TINY.eos_token_ids)) for p in prompts]
    )
    assert [s.tokens() for s in senders] == [r.tokens for r in want]
    assert sum(s.stats()["accepted_tokens"] for s in senders) >= 0
    c = orch.batcher.metrics.counters
    for model, (sent, got) in crossed.items():
        assert orch.bls_time[model][2:] == [sent, got]  # the transport's count: every byte that crossed
        published = [
            c[("bls_bytes_total", (("direction", d), ("model_called", model)))] for d in ("in", "out")
        ]
        assert 0 < published[0] <= sent and 0 < published[1] <= got  # metrics: up to the last busy round
    assert crossed["target"][1] > crossed["target"][0] > 0  # logits dominate what comes back
    assert bls_bytes({"a": np.zeros((2, 3), np.float32), "b": np.zeros(4, np.int64)}) == 24 + 32
    assert services["target"].active == 0


def test_services_refuse_a_gpu_runtime_where_there_is_none(built, monkeypatch):
    _, eng, ckpt = built
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for runtime in ("ort", "torch", "tensorrt"):
        p = {**_params(eng, ckpt, runtime, "target"), "device": "cuda"}
        with pytest.raises(RuntimeUnavailable):
            make_service(p)
