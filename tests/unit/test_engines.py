"""Engines (issue 4) on tiny models: every graph against PyTorch, the engine runners through
the reference loop against the target alone, buckets, refusals, incremental builds."""

import copy
import json

import pytest
import torch

from dspark.core.interfaces import Request
from dspark.core.reference import generate
from dspark.core.sampling import SamplingParams
from dspark.core.scheduler import policy_for
from dspark.core.sps import SPSTable
from dspark.engines.build import BuildConfig, Builder, build_drafter, build_target, sha256_tensors
from dspark.engines.ort import OrtDrafterRunner, OrtTargetRunner, ShapeError, session
from dspark.models.block_drafter import BlockDrafterRunner
from dspark.models.target import TargetRunner
from tests.conftest import TINY, tiny_target
from tests.unit.test_block_drafter import _drafter

BUCKETS = [1, 2, 4]
MAX_CONTEXT = 64


def _target32():
    return tiny_target().float().eval()


def _build(tmp, head, target, log=None):
    kind = "dflash" if head == "none" else "dspark"
    m = _drafter(kind=kind, head=head if head != "none" else "markov", target=target)
    b = Builder(
        tmp, BuildConfig(buckets=BUCKETS, max_context=MAX_CONTEXT, threads=1), log=log or (lambda s: None)
    )
    build_target(b, target, sha256_tensors(target))
    build_drafter(b, m, sha256_tensors(m), {})
    b.write_manifest({})
    return m


@pytest.fixture(scope="module", params=["markov", "rnn", "none"])
def built(request, tmp_path_factory):
    target = _target32()
    out = tmp_path_factory.mktemp(f"engines-{request.param}")
    m = _build(out, request.param, target)
    return request.param, target, m, out


def test_manifest_lists_every_engine_verified_with_hashes_and_versions(built):
    head, _, _, out = built
    man = json.loads((out / "manifest.json").read_text())
    roles = [e["role"] for e in man["engines"]]
    assert roles.count("target") == 1 and roles.count("drafter_context") == 1
    assert roles.count("drafter_backbone") == len(BUCKETS)
    assert roles.count("drafter_head") == (0 if head == "none" else len(BUCKETS))
    for e in man["engines"]:
        assert (out / e["file"]).exists() and (out / e["optimized_file"]).exists()
        assert len(e["onnx_sha256"]) == 64 and len(e["source_sha256"]) == 64
        assert e["verified"]["max_abs_diff_vs_pytorch"] <= 1e-3
        assert e["io"]["inputs"] and e["io"]["outputs"]
    assert {"torch", "onnx", "onnxruntime", "polygraphy"} <= set(man["tools"])
    assert man["tensorrt"]["built"] is False and man["tensorrt"]["reason"]
    bb = [e for e in man["engines"] if e["role"] == "drafter_backbone"]
    assert sorted(e["shape"]["batch"] for e in bb) == BUCKETS
    assert bb[0]["io"]["inputs"]["ctx_key.0"]["shape"] == [1, TINY.num_kv_heads, "S", TINY.head_dim]


def test_rebuild_is_incremental_and_follows_the_checkpoint(tmp_path):
    target = _target32()
    _build(tmp_path, "markov", target)
    lines = []
    _build(tmp_path, "markov", target, log=lines.append)  # same weights: nothing rebuilt
    assert lines and all("up to date" in s for s in lines)
    lines.clear()
    m = _drafter(kind="dspark", head="markov", seed=3, target=target)  # new drafter weights
    b = Builder(tmp_path, BuildConfig(buckets=BUCKETS, max_context=MAX_CONTEXT, threads=1), log=lines.append)
    build_target(b, target, sha256_tensors(target))
    build_drafter(b, m, sha256_tensors(m), {})
    assert any("target.onnx: up to date" in s for s in lines)
    assert not any("drafter" in s and "up to date" in s for s in lines)


def test_target_engine_equals_pytorch_through_prefill_verify_and_rollback(built):
    _, target, _, out = built
    ort_t = OrtTargetRunner(session(out / "target.opt.onnx", 1), TINY, num_slots=3, max_len=40)
    pt_t = TargetRunner(target, num_slots=3, max_len=40)
    g = torch.Generator().manual_seed(4)
    for runner in (ort_t, pt_t):
        assert [runner.allocate() for _ in range(3)] == [0, 1, 2]
    steps = [[9, 3, 5], [2, 1, 4]]  # new tokens per slot per step (ragged)
    for it, lens in enumerate(steps):
        toks = [torch.randint(1, TINY.vocab_size, (n,), generator=g).tolist() for n in lens]
        a, b = ort_t.step([0, 1, 2], toks), pt_t.step([0, 1, 2], toks)
        for r, n in enumerate(lens):
            assert torch.allclose(a.logits[r, :n], b.logits[r, :n], atol=1e-3)
            assert torch.allclose(a.features[r, :n], b.features[r, :n], atol=1e-3)
            assert torch.equal(a.logits[r, :n].argmax(-1), b.logits[r, :n].argmax(-1))
        if it == 0:
            for runner in (ort_t, pt_t):
                runner.rollback(0, 6)  # rejected drafts are forgotten
    assert [ort_t.length(s) for s in range(3)] == [pt_t.length(s) for s in range(3)] == [8, 4, 9]
    with pytest.raises(ShapeError, match="KV cache length 40"):
        ort_t.step([2], [list(range(1, 40))])
    ort_t.release(1)
    assert ort_t.allocate() == 1


def _requests(params=None):
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, TINY.vocab_size, (n,), generator=g).tolist() for n in (4, 11, 7)]
    return [
        Request(p, max_tokens=24, stop_ids=frozenset({0}), params=params or SamplingParams()) for p in prompts
    ]


@pytest.mark.parametrize("mode", ["static:4", "dspark"])
def test_greedy_through_the_engines_equals_the_target_alone(built, mode):
    head, target, m, out = built
    reqs = _requests()
    plain = [r.tokens for r in generate(TargetRunner(target, 4, 64), reqs)]
    sps = SPSTable.from_step_times([1, 64], [1.0, 1.0 + 0.05 * 63])
    ort_t = OrtTargetRunner(session(out / "target.opt.onnx", 1), TINY, 4, 64)
    drafter = OrtDrafterRunner.load(out, num_slots=4, threads=1)
    res = generate(ort_t, reqs, drafter=drafter, policy=policy_for(mode, sps))
    assert [r.tokens for r in res] == plain
    assert sum(r.stats.accepted_tokens for r in res) > 0 or head == "none"
    # the same drafter in PyTorch proposes the same blocks: identical acceptance
    pt = generate(
        TargetRunner(target, 4, 64),
        reqs,
        drafter=BlockDrafterRunner(
            copy.deepcopy(m).float().attach(target.model.embed_tokens.weight, target.lm_head.weight), 4, 64
        ),
        policy=policy_for(mode, sps),
    )
    assert [r.stats.accepted_tokens for r in pt] == [r.stats.accepted_tokens for r in res]
    assert drafter.free_slots == 4 and ort_t.cache.free_slots == 4  # everything released


def test_sampling_through_the_engines_draws_what_pytorch_draws(built):
    """Same seeds, same uniforms: the engine path samples the same tokens as the PyTorch
    reference loop (whose losslessness is tested statistically in test_lossless_sampling)."""
    _, target, m, out = built
    reqs = _requests([SamplingParams(1.0, seed=s) for s in range(3)][0])
    reqs = [Request(r.prompt_ids, 24, SamplingParams(1.0, seed=i), r.stop_ids) for i, r in enumerate(reqs)]
    pm = copy.deepcopy(m).float().attach(target.model.embed_tokens.weight, target.lm_head.weight)
    pt = generate(TargetRunner(target, 4, 64), reqs, BlockDrafterRunner(pm, 4, 64), policy_for("static:3"))
    ort_t = OrtTargetRunner(session(out / "target.opt.onnx", 1), TINY, 4, 64)
    res = generate(ort_t, reqs, OrtDrafterRunner.load(out, 4, 1), policy_for("static:3"))
    assert [r.tokens for r in res] == [r.tokens for r in pt]


def test_batches_above_the_largest_bucket_run_in_chunks_and_other_shapes_are_refused(built):
    _, _, _, out = built
    d = OrtDrafterRunner.load(out, num_slots=6, threads=1)
    feats = torch.randn(5, TINY.feature_size, generator=torch.Generator().manual_seed(2))
    for rid in range(5):
        d.begin(rid, [1] * 5, feats)
    params = [SamplingParams()] * 5
    gens = [torch.Generator().manual_seed(0) for _ in range(5)]
    prop = d.propose(list(range(5)), [1] * 5, params, gens)  # buckets 1, 4: chunks of 4 + 1
    one = OrtDrafterRunner.load(out, num_slots=1, threads=1)
    one.begin(0, [1] * 5, feats)
    alone = one.propose([0], [1], params[:1], gens[:1])
    assert all(prop.tokens[r].tolist() == alone.tokens[0].tolist() for r in range(5))
    with pytest.raises(ShapeError, match="max_context 64"):
        d.begin(9, [1] * 70, torch.zeros(70, TINY.feature_size))
    assert d.free_slots == 1  # the refused request took no slot
    with pytest.raises(ShapeError, match="max_context 64"):
        d.advance(0, [1] * 60, torch.zeros(60, TINY.feature_size))
    for rid in range(5):
        d.end(rid)
    assert d.free_slots == 6


def test_engine_runner_flushes_more_than_one_round_of_new_context(built):
    """advance() with more positions than a round holds goes through the context engine and
    gives the same blocks as the PyTorch runner."""
    _, target, m, out = built
    pm = copy.deepcopy(m).float().attach(target.model.embed_tokens.weight, target.lm_head.weight)
    d, p = OrtDrafterRunner.load(out, num_slots=2, threads=1), BlockDrafterRunner(pm, 2, 64)
    g = torch.Generator().manual_seed(7)
    f1, f2 = torch.randn(6, TINY.feature_size, generator=g), torch.randn(13, TINY.feature_size, generator=g)
    for r in (d, p):
        r.begin(0, [1] * 6, f1)
        r.advance(0, [1] * 13, f2)
    args = ([0], [5], [SamplingParams()])
    a = d.propose(*args, [torch.Generator().manual_seed(0)])
    b = p.propose(*args, [torch.Generator().manual_seed(0)])
    assert torch.equal(a.tokens, b.tokens)
    assert torch.allclose(a.conf_logits, b.conf_logits, atol=1e-3)


def test_int8_drafter_engines_stay_lossless_and_rebuild_incrementally(tmp_path):
    """`--drafter-precision int8`: the backbone and head graphs with int8 weights, drafter_meta.json pointing
    at them; a different proposer, the same greedy output (the fp32 target verifies)."""
    from dspark.engines.build import INT8_DRAFTER, build_int8_drafter

    target = _target32()
    _build(tmp_path, "markov", target)
    b = Builder(
        tmp_path, BuildConfig(buckets=BUCKETS, max_context=MAX_CONTEXT, threads=1), log=lambda s: None
    )
    build_target(b, target, sha256_tensors(target))
    m = _drafter(kind="dspark", head="markov", target=target)
    build_drafter(b, m, sha256_tensors(m), {})
    meta = build_int8_drafter(b)
    b.write_manifest({})
    assert meta["drafter_precision"] == INT8_DRAFTER
    for role in ("drafter_backbone", "drafter_head"):
        files = meta["files"][role]
        assert sorted(int(k) for k in files) == BUCKETS
        assert all(f.endswith(".int8.opt.onnx") and (tmp_path / f).exists() for f in files.values())
    assert meta["files"]["drafter_context"] == "drafter_context.opt.onnx"  # stays fp32
    on_disk = json.loads((tmp_path / "drafter_meta.json").read_text())
    assert on_disk["files"] == meta["files"]
    roles = [e["role"] for e in json.loads((tmp_path / "manifest.json").read_text())["engines"]]
    assert roles.count("drafter_backbone_int8") == roles.count("drafter_head_int8") == len(BUCKETS)
    sps = SPSTable.from_step_times([1, 64], [1.0, 1.0 + 0.05 * 63])
    reqs = _requests()
    plain = [r.tokens for r in generate(TargetRunner(target, 4, 64), reqs)]
    ort_t = OrtTargetRunner(session(tmp_path / "target.opt.onnx", 1), TINY, 4, 64)
    res = generate(
        ort_t, reqs, OrtDrafterRunner.load(tmp_path, num_slots=4, threads=1), policy_for("dspark", sps)
    )
    assert [r.tokens for r in res] == plain
    assert sum(r.stats.accepted_tokens for r in res) > 0
    lines: list[str] = []
    b = Builder(tmp_path, BuildConfig(buckets=BUCKETS, max_context=MAX_CONTEXT, threads=1), log=lines.append)
    build_target(b, target, sha256_tensors(target))
    build_drafter(b, m, sha256_tensors(m), {})
    build_int8_drafter(b)
    assert lines and all("up to date" in s for s in lines)


def test_target_cache_rebuilt_on_the_engine_equals_the_pytorch_rebuild(tmp_path):
    """`dspark data --engines` rebuilds the training cache on the ORT target engine (issue 12:
    the per-machine rebuild is the cost every fresh machine pays): same samples, same values."""
    import numpy as np

    from dspark.models.loading import LoadedTarget
    from dspark.training.data import Prompt, build_cache, regenerate
    from tests.unit.test_data import CharTokenizer

    target, out = _target32(), tmp_path / "engines"
    b = Builder(out, BuildConfig(buckets=BUCKETS, max_context=MAX_CONTEXT, threads=1), log=lambda s: None)
    build_target(b, target, sha256_tensors(target))
    loaded = LoadedTarget(target, CharTokenizer(), "tiny")
    prompts = [Prompt("pool", i, f"q{i}?" * (1 + i % 2)) for i in range(3)]
    regenerate(loaded, prompts, tmp_path / "a.jsonl", batch=2, max_new_tokens=8)
    assert build_cache(loaded, tmp_path / "a.jsonl", tmp_path / "torch") == 3
    made = []

    def engine(max_len):
        made.append(max_len)
        return OrtTargetRunner(session(out / "target.opt.onnx", 1), TINY, 1, max_len)

    assert build_cache(loaded, tmp_path / "a.jsonl", tmp_path / "ort", make_runner=engine) == 3
    assert len(made) == 1  # one engine runner for the whole rebuild, sized to the longest sample
    for f in sorted((tmp_path / "torch").glob("*.npz")):
        a, b = np.load(f), np.load(tmp_path / "ort" / f.name)
        assert a["tokens"].tolist() == b["tokens"].tolist() and int(a["prompt_len"]) == int(b["prompt_len"])
        for k in ("features", "last_hidden"):
            assert np.allclose(a[k], b[k], atol=2e-3 * np.abs(a[k]).max()), k
        assert np.allclose(a["lse"], b["lse"], atol=1e-4)
