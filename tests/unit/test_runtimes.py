"""Runtimes (issue 13) on the CPU: the device-generic path (slots on the device, IOBinding, the
PyTorch graph modules as a runtime) runs through the same code with device `cpu`; the fp32 RoPE
table; no empty tensor; the CUDA/TensorRT-only paths refuse clearly where they are absent."""

import copy
import json

import numpy as np
import onnx
import pytest
import torch

from dspark.core.interfaces import Request
from dspark.core.reference import generate
from dspark.core.scheduler import policy_for
from dspark.core.sps import SPSTable
from dspark.engines import tensorrt as trt_mod
from dspark.engines.ort import CPU_CALL_OVERHEAD, OrtDrafterRunner, OrtTargetRunner, length_groups, session
from dspark.engines.runtimes import (
    DeviceKV,
    OrtGraph,
    RuntimeSpec,
    RuntimeUnavailable,
    required_files,
    target_graph,
    torch_drafter_graphs,
    torch_target_graph,
)
from dspark.export import target as ext
from dspark.models.target import ROPE_TABLE_POSITIONS, TargetRunner, rope_cos_sin
from tests.conftest import TINY
from tests.unit.test_engines import _build, _target32

SPS = SPSTable.from_step_times([1, 64], [1.0, 1.0 + 0.05 * 63])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    target = _target32()
    out = tmp_path_factory.mktemp("rt-rnn")
    m = _build(out, "rnn", target)
    return target, m, out


def _f32(m, target):
    return copy.deepcopy(m).float().attach(target.model.embed_tokens.weight, target.lm_head.weight)


def _torch_graphs(m, meta, device="cpu"):
    """The drafter's graphs in the torch runtime, from the PyTorch drafter itself."""
    return torch_drafter_graphs(m, meta, device)


def _torch_target(target, device="cpu"):
    return torch_target_graph(target, device)


# -- RoPE and the graphs TensorRT accepts ------------------------------------------------------


LLAMA31 = (8.0, 1.0, 4.0, 8192.0)  # Llama-3.1's RoPE scaling (factor, low, high, original context)


@pytest.mark.parametrize(
    ("head_dim", "theta", "scaling"),
    [(64, 100000.0, None), (8, 10000.0, None), (128, 1000000.0, None), (128, 500000.0, LLAMA31)],
)
def test_rope_table_equals_the_float64_computation_to_fp32_rounding(monkeypatch, head_dim, theta, scaling):
    pos = torch.tensor([[0, 1, 2, 777], [4095, 2048, ROPE_TABLE_POSITIONS - 1, 5]])
    want = rope_cos_sin(pos, head_dim, theta, torch.float32, scaling)  # float64, rounded once
    monkeypatch.setattr(torch.onnx, "is_in_onnx_export", lambda: True)
    got = rope_cos_sin(pos, head_dim, theta, torch.float32, scaling)  # the exported graph's table gather
    assert got[0].dtype == torch.float32
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_exported_graphs_have_no_float64_and_declare_every_output_shape(built):
    _, _, out = built
    man = json.loads((out / "manifest.json").read_text())
    for e in man["engines"]:
        g = onnx.shape_inference.infer_shapes(onnx.load(str(out / e["file"])))
        vis = list(g.graph.value_info) + list(g.graph.output) + list(g.graph.input)
        doubles = [v.name for v in vis if v.type.tensor_type.elem_type == onnx.TensorProto.DOUBLE]
        doubles += [i.name for i in g.graph.initializer if i.data_type == onnx.TensorProto.DOUBLE]
        assert not doubles, f"{e['file']}: float64 tensors {doubles[:5]}"
        in_dims = {d for spec in e["io"]["inputs"].values() for d in spec["shape"] if isinstance(d, str)}
        for name, spec in e["io"]["outputs"].items():
            assert all(isinstance(d, int) or d in in_dims for d in spec["shape"]), (e["file"], name, spec)


# -- slots on the device ---------------------------------------------------------------------


def test_device_slots_gather_and_scatter_like_the_per_row_copies():
    kv = DeviceKV(2, 4, 2, 10, 3, "test", "cpu")
    g = torch.Generator().manual_seed(0)
    new_k = [torch.randn(3, 2, 4, 3, generator=g) for _ in range(2)]
    new_v = [torch.randn(3, 2, 4, 3, generator=g) for _ in range(2)]
    slots, start, count = [2, 0, 3], [1, 0, 5], [4, 2, 3]
    kv.write(slots, start, new_k, [v.numpy() for v in new_v], count)  # tensors or numpy arrays
    for layer in range(2):
        for r, (s, s0, n) in enumerate(zip(slots, start, count)):
            assert torch.equal(kv.k[layer][s, :, s0 : s0 + n], new_k[layer][r, :, :n])
            assert torch.equal(kv.v[layer][s, :, s0 : s0 + n], new_v[layer][r, :, :n])
    k, v = kv.gather([3, 2], 7)
    assert k[0].shape == (2, 2, 7, 3) and k[0].is_contiguous()
    assert torch.equal(k[1][1], kv.k[1][2, :, :7]) and torch.equal(v[0][0], kv.v[0][3, :, :7])
    kv.write([1], [0], new_k, new_v, [0])  # nothing to write is fine
    packed = DeviceKV(2, 4, 2, 10, 3, "test", "cpu")  # the rows' positions one after another
    flat_k = [torch.cat([k[r, :, :n] for r, n in enumerate(count)], dim=1)[None] for k in new_k]
    flat_v = [torch.cat([v[r, :, :n] for r, n in enumerate(count)], dim=1)[None] for v in new_v]
    packed.write(slots, start, flat_k, flat_v, count, packed=True)
    for a, b in zip(packed.k + packed.v, kv.k + kv.v):
        for s, s0, n in zip(slots, start, count):
            assert torch.equal(a[s, :, s0 : s0 + n], b[s, :, s0 : s0 + n])


# -- IOBinding and the torch runtime on device cpu ----------------------------------------------


def test_iobinding_equals_a_plain_session_run(built):
    _, _, out = built
    sess = session(out / "target.opt.onnx", 1)
    feed = {
        n: ext.example_inputs(_target32(), rows=2, new=3, past=4)[i].numpy()
        for i, n in enumerate(ext.input_names(TINY.num_layers))
    }
    plain = sess.run(None, feed)
    bound = OrtGraph(sess, "cpu").run(None, {k: torch.from_numpy(v) for k, v in feed.items()})
    for a, b in zip(plain, bound):
        assert isinstance(b, torch.Tensor) and b.shape == a.shape
        assert np.array_equal(a, b.numpy())


def _requests():
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, TINY.vocab_size, (n,), generator=g).tolist() for n in (4, 11, 7)]
    return [Request(p, max_tokens=20, stop_ids=frozenset({0})) for p in prompts]


@pytest.mark.parametrize("mode", ["off", "dspark"])
def test_torch_and_ort_runtimes_on_device_cpu_give_the_target_alone(built, mode):
    """The same runners (device slots, gather/scatter on the device) over the ORT graphs with
    IOBinding and over the PyTorch graph modules: greedy tokens equal the PyTorch target."""
    target, m, out = built
    meta = json.loads((out / "drafter_meta.json").read_text())
    plain = [r.tokens for r in generate(TargetRunner(target, 4, 64), _requests())]
    pm = _f32(m, target)
    runtimes = {
        "ort": (
            OrtTargetRunner(OrtGraph(session(out / "target.opt.onnx", 1)), TINY, 4, 64),
            OrtDrafterRunner.open(out, RuntimeSpec("ort", "cpu", threads=1), 4),
        ),
        "torch": (
            OrtTargetRunner(_torch_target(target), TINY, 4, 64),
            OrtDrafterRunner(_torch_graphs(pm, meta), meta, 4),
        ),
    }
    accepted = {}
    for name, (t, d) in runtimes.items():
        assert t.cache.k[0].device.type == "cpu" and d.cache.k[0].device.type == "cpu"
        res = generate(t, _requests(), drafter=d if mode != "off" else None, policy=policy_for(mode, SPS))
        assert [r.tokens for r in res] == plain, name
        accepted[name] = [r.stats.accepted_tokens for r in res]
        assert t.cache.free_slots == 4 and d.free_slots == 4
    assert accepted["ort"] == accepted["torch"]


def test_a_prefill_passes_one_masked_past_position_and_changes_nothing(built):
    """Past length 0 never becomes an empty tensor (TensorRT profiles start at 1): the runner
    gathers one masked position; the outputs equal the graph run with S = 0."""
    _, _, out = built
    sess = session(out / "target.opt.onnx", 1)
    seen = []

    class Spy(OrtGraph):
        def run(self, names, feed):
            seen.append(feed["past_key.0"].shape[2])
            return super().run(names, feed)

    runner = OrtTargetRunner(Spy(sess), TINY, 2, 32)
    toks = [[5, 9, 2, 7], [3, 1]]
    slots = [runner.allocate(), runner.allocate()]
    step = runner.step(slots, toks)
    assert seen == [1]
    L = TINY.num_layers
    feed = {
        "input_ids": np.array([[5, 9, 2, 7], [3, 1, 0, 0]]),
        "positions": np.tile(np.arange(4), (2, 1)),
        "past_len": np.zeros(2, np.int64),
        "valid": np.array([[1, 1, 1, 1], [1, 1, 0, 0]], bool),
    }
    for n in ext.input_names(L)[4:]:
        feed[n] = np.zeros((2, TINY.num_kv_heads, 0, TINY.head_dim), np.float32)
    ref = sess.run(None, feed)
    for r, n in enumerate((4, 2)):
        # the same numbers up to the order of a softmax sum (one more exp(-1e9) = 0 term)
        assert np.allclose(step.logits[r, :n].numpy(), ref[0][r, :n], atol=1e-5, rtol=0)
        assert np.allclose(step.features[r, :n].numpy(), ref[1][r, :n], atol=1e-5, rtol=1e-6)
        assert np.array_equal(step.logits[r, :n].numpy().argmax(-1), ref[0][r, :n].argmax(-1))


class _Limited(OrtGraph):
    """An ORT graph that says it holds only small calls, like a TensorRT plan's profiles."""

    def __init__(self, sess, boxes):
        super().__init__(sess)
        self.boxes, self.calls = boxes, []

    def limits(self):
        return [
            {"input_ids": ((1, 1), (r, t)), "past_key.0": ((1, 1, 1, 1), (r, 2, s, 8))}
            for r, t, s in self.boxes
        ]

    def run(self, names, feed):
        R, N = feed["input_ids"].shape
        assert any(R <= r and N <= t for r, t, _ in self.boxes), (R, N)
        self.calls.append((R, N))
        return super().run(names, feed)


def test_calls_larger_than_the_plan_run_in_pieces_with_the_same_result(built):
    _, _, out = built
    sess = session(out / "target.opt.onnx", 1)
    limited = _Limited(sess, [(2, 3, 64), (1, 8, 64)])  # decode: 2 rows × 3; prefill: 1 row × 8
    a = OrtTargetRunner(limited, TINY, 5, 64)
    b = OrtTargetRunner(OrtGraph(sess), TINY, 5, 64, group_overhead=None)
    g = torch.Generator().manual_seed(3)
    for r in (a, b):
        [r.allocate() for _ in range(5)]
    for lens in ([13, 4, 9, 1, 6], [3, 1, 2, 3, 3], [1, 1, 1, 1, 1]):
        toks = [torch.randint(1, TINY.vocab_size, (n,), generator=g).tolist() for n in lens]
        x, y = a.step(list(range(5)), toks), b.step(list(range(5)), toks)
        for r, n in enumerate(lens):
            assert torch.allclose(x.logits[r, :n], y.logits[r, :n], atol=1e-5)
            assert torch.allclose(x.features[r, :n], y.features[r, :n], atol=1e-4)
        last = a.step([0, 2], [[4], [6]], last_only=True), b.step([0, 2], [[4], [6]], last_only=True)
        assert last[0].logits.shape == (2, 1, TINY.vocab_size)
        assert torch.allclose(last[0].logits, last[1].logits, atol=1e-5)
    assert [a.length(s) for s in range(5)] == [b.length(s) for s in range(5)]
    assert max(n for _, n in limited.calls) <= 8 and (1, 8) in limited.calls
    with pytest.raises(ValueError, match="past positions the target plan was built for"):
        OrtTargetRunner(limited, TINY, 2, 128)


class _Recorder(OrtGraph):
    def __init__(self, sess):
        super().__init__(sess)
        self.calls = []

    def run(self, names, feed):
        self.calls.append(feed["input_ids"].shape)
        return super().run(names, feed)


def test_rows_of_different_lengths_run_in_length_groups_with_the_same_result(built):
    _, _, out = built
    sess = session(out / "target.opt.onnx", 1)
    rec = _Recorder(sess)
    a = OrtTargetRunner(rec, TINY, 6, 64)  # CPU: grouped by default
    b = OrtTargetRunner(OrtGraph(sess), TINY, 6, 64, group_overhead=None)
    assert a.group_overhead == CPU_CALL_OVERHEAD and b.group_overhead is None
    g = torch.Generator().manual_seed(5)
    for r in (a, b):
        [r.allocate() for _ in range(6)]
    for lens in ([5, 3, 7, 2, 6, 4], [8, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [1, 8, 2, 1, 8, 1]):
        rec.calls.clear()
        toks = [torch.randint(1, TINY.vocab_size, (n,), generator=g).tolist() for n in lens]
        x, y = a.step(list(range(6)), toks), b.step(list(range(6)), toks)
        assert x.logits.shape == y.logits.shape == (6, max(lens), TINY.vocab_size)
        for r, n in enumerate(lens):
            assert torch.allclose(x.logits[r, :n], y.logits[r, :n], atol=1e-5)
            assert torch.equal(x.logits[r, :n].argmax(-1), y.logits[r, :n].argmax(-1))
            assert torch.allclose(x.features[r, :n], y.features[r, :n], atol=1e-4)
        expect = [tuple(map(len, length_groups(np.array(lens), CPU_CALL_OVERHEAD)))]
        assert [c[0] for c in rec.calls] == list(expect[0])
        if lens[0] == 8:  # one long verify among short ones: 5 + 1 rows, not 6 × 8
            assert sorted(rec.calls) == [(1, 8), (5, 1)]
    rec.calls.clear()  # a prefill of prompts of different lengths: the last logits of each row
    toks = [torch.randint(1, TINY.vocab_size, (n,), generator=g).tolist() for n in (9, 1, 2, 9, 1, 1)]
    x, y = a.step(list(range(6)), toks, last_only=True), b.step(list(range(6)), toks, last_only=True)
    assert len(rec.calls) > 1 and x.logits.shape == y.logits.shape == (6, 1, TINY.vocab_size)
    assert torch.allclose(x.logits, y.logits, atol=1e-5)
    assert [a.length(s) for s in range(6)] == [b.length(s) for s in range(6)]


def _partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for p in _partitions(rest):
        yield [[first]] + p
        for i in range(len(p)):
            yield p[:i] + [[first] + p[i]] + p[i + 1 :]


@pytest.mark.parametrize("overhead", [0.0, 1.0, 4.0, 30.0])
def test_length_groups_is_the_cheapest_partition(overhead):
    rng = np.random.default_rng(int(overhead))
    for _ in range(40):
        n = rng.integers(1, 9, size=int(rng.integers(1, 7)))
        groups = length_groups(n, overhead)
        assert sorted(np.concatenate(groups).tolist()) == list(range(len(n)))
        assert all(np.all(np.diff(g) > 0) for g in groups)  # each group keeps the rows' order

        def cost(part, n=n):
            return sum(len(g) * int(n[list(g)].max()) + overhead for g in part)

        best = min(cost(p) for p in _partitions(list(range(len(n)))))
        assert cost(groups) == pytest.approx(best)
        if len(groups) > 1:
            assert cost(groups) < cost([range(len(n))])  # split only when it pays


def test_a_runner_refuses_more_positions_than_the_rope_table(built):
    _, _, out = built
    with pytest.raises(ValueError, match="RoPE table"):
        OrtTargetRunner(session(out / "target.opt.onnx", 1), TINY, 1, 9000, max_positions=8192)
    meta = json.loads((out / "target_meta.json").read_text())
    assert meta["rope_positions"] == ROPE_TABLE_POSITIONS


# -- what is not here refuses clearly ---------------------------------------------------------


def test_cuda_and_tensorrt_are_clear_errors_without_them(built, monkeypatch):
    _, _, out = built
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeUnavailable, match="GPU|CPU-only"):
        RuntimeSpec("ort", "cuda:0").check()
    with pytest.raises(RuntimeUnavailable, match="GPU|CPU-only"):
        target_graph(out, RuntimeSpec("torch", "cuda"), "/nonexistent")
    with pytest.raises(RuntimeUnavailable, match="providers"):
        RuntimeSpec("ort", "cpu", providers=("CUDAExecutionProvider",)).check()
    if trt_mod.tensorrt_version() is None:
        with pytest.raises(RuntimeUnavailable, match="tensorrt"):
            trt_mod.require_tensorrt()
    with pytest.raises(ValueError, match="GPU"):
        RuntimeSpec("tensorrt", "cpu")
    with pytest.raises(ValueError, match="unknown runtime"):
        RuntimeSpec("tvm")
    spec = RuntimeSpec.from_params({"runtime": "onnxruntime", "device": "cuda", "device_id": "1"})
    assert spec.runtime == "ort" and spec.device == "cuda:1"
    assert not any(f.suffix == ".plan" for f in required_files(out, RuntimeSpec(), "target"))


def _fake_plan(out, version):
    man = json.loads((out / "manifest.json").read_text())
    man["engines"] = [e for e in man["engines"] if e.get("backend") != "tensorrt"]
    man["engines"].append(
        {"backend": "tensorrt", "role": "target", "file": "target.fp32.plan", "plan": "target.fp32.plan",
         "precision": "fp32", "tensorrt_version": version}
    )  # fmt: skip
    (out / "manifest.json").write_text(json.dumps(man))
    (out / "target.fp32.plan").write_bytes(b"not a real plan")


def test_a_plan_built_by_another_tensorrt_version_is_refused(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"engines": []}))
    with pytest.raises(FileNotFoundError, match="make engines PROFILE=gpu"):
        trt_mod.plan_entry(tmp_path, "target.onnx", "fp32", installed="10.16.1.11")
    _fake_plan(tmp_path, "10.5.0")
    with pytest.raises(trt_mod.PlanVersionError, match=r"built by TensorRT 10\.5\.0.*TensorRT 10\.16\.1\.11"):
        trt_mod.plan_entry(tmp_path, "target.onnx", "fp32", installed="10.16.1.11")
    with pytest.raises(RuntimeUnavailable, match="not installed"):
        trt_mod.plan_entry(tmp_path, "target.onnx", "fp32", installed=None)
    assert (
        trt_mod.plan_entry(tmp_path, "target.opt.onnx", "fp32", installed="10.5.0")["plan"]
        == "target.fp32.plan"
    )
    with pytest.raises(FileNotFoundError, match="fp16"):
        trt_mod.plan_entry(tmp_path, "target.onnx", "fp16", installed="10.5.0")


def test_plan_profiles_cover_every_input_with_no_empty_dim(built):
    _, _, out = built
    man = json.loads((out / "manifest.json").read_text())
    s = trt_mod.PlanSettings(
        max_rows=8, prefill_tokens=64, max_len=64, max_context=64, context_buckets=[32, 64]
    )
    for e in man["engines"]:
        profiles = trt_mod.plan_profiles(e["role"], e["io"], s)
        dynamic = any(isinstance(d, str) for spec in e["io"]["inputs"].values() for d in spec["shape"])
        assert bool(profiles) == dynamic, e["file"]
        for p in profiles:
            assert set(p) == set(e["io"]["inputs"])
            for lo, opt, hi in p.values():
                assert min(lo) >= 1 and all(a <= b <= c for a, b, c in zip(lo, opt, hi))
        if e["role"] == "target":
            assert [p["input_ids"][2] for p in profiles] == [[8, 16], [4, 64]]
            assert all(p["past_key.0"][2][2] == 64 for p in profiles)
        if e["role"] == "drafter_backbone":
            assert [p["ctx_key.0"][0][2] for p in profiles] == [32, 64]


def test_runtime_tensorrt_without_tensorrt_is_a_clear_error_even_with_a_gpu(monkeypatch):
    """Past the GPU check, the missing tensorrt package is named (never the CPU path instead)."""
    if trt_mod.tensorrt_version() is not None:
        pytest.skip("tensorrt is installed here")
    import dspark.engines.runtimes as rt

    monkeypatch.setattr(rt, "require_cuda", lambda d="cuda": torch.device(d))
    with pytest.raises(
        RuntimeUnavailable, match="tensorrt Python package is not installed.*make setup GPU=1"
    ):
        RuntimeSpec("tensorrt", "cuda:0").check()
