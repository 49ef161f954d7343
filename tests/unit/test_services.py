"""The model services and the orchestrator's remote clients, in-process (tiny engines)."""

import json

import numpy as np
import pytest
import torch

from dspark.core.interfaces import RequestError
from dspark.core.reference import generate
from dspark.core.sampling import SamplingParams
from dspark.core.sps import SPSTable
from dspark.engines.ort import OrtDrafterRunner, OrtTargetRunner, draft_vocabulary, session
from dspark.model_repository.services import DrafterBackboneService, DrafterHeadService, TargetService
from dspark.models.block_drafter import sample_block
from dspark.models.target import TargetRunner
from dspark.orchestrator.batcher import Batcher
from dspark.orchestrator.bls import RemoteDrafter, RemoteTarget
from tests.conftest import TINY
from tests.unit.test_engine import Collect, _reqs
from tests.unit.test_engines import _build, _target32

SPS = SPSTable.from_step_times([1, 64], [1.0, 1.0 + 0.05 * 63])


@pytest.fixture(scope="module", params=["markov", "rnn"])
def built(request, tmp_path_factory):
    target = _target32()
    out = tmp_path_factory.mktemp(f"svc-{request.param}")
    _build(out, request.param, target)
    return target, out


def _services(out, slots=3):
    sess = session(out / "target.opt.onnx", 1)
    tsvc = TargetService(
        OrtTargetRunner(sess, TINY, slots, 96), lambda rows, length: OrtTargetRunner(sess, TINY, rows, length)
    )
    drafter = OrtDrafterRunner.load(out, num_slots=slots, threads=1)
    svcs = {
        "target": tsvc,
        "drafter_backbone": DrafterBackboneService(drafter),
        "drafter_head": DrafterHeadService(drafter),
    }
    calls = []

    def call(model, inputs, outputs):
        calls.append(model + (":release" if "release_ids" in inputs else ""))
        res = svcs[model].handle(inputs)
        return {k: res[k] for k in outputs}

    meta = json.loads((out / "drafter_meta.json").read_text())
    return svcs, call, meta, calls


@pytest.mark.parametrize("head_block", [True, False])
@pytest.mark.parametrize("mode", ["static:3", "dspark"])
def test_engine_over_remote_models_equals_the_target_alone(built, mode, head_block):
    target, out = built
    svcs, call, meta, calls = _services(out)
    reqs = _reqs(5)
    plain = [r.tokens for r in generate(TargetRunner(target, 5, 96), reqs)]
    drafter = RemoteDrafter(call, meta, 3, head_block=head_block)
    eng = Batcher(RemoteTarget(call, TINY.vocab_size, 3, 96), drafter, SPS, None, 3)
    sinks = [Collect() for _ in reqs]
    for r, s in zip(reqs, sinks):
        eng.submit(r, mode, s)
    eng.run_until_idle(500)
    assert [s.out for s in sinks] == plain
    assert svcs["target"].active == 0 and not svcs["drafter_backbone"].known  # all released
    assert svcs["drafter_backbone"].drafter.free_slots == 3
    # one head call per draft round with the block entry, γ without it
    per_round = 1 if head_block else meta["config"]["block_size"]
    assert calls.count("drafter_head") == calls.count("drafter_backbone") * per_round > 0


@pytest.mark.parametrize("head_block", [True, False])
def test_sampled_tokens_over_remote_models_equal_the_in_process_engines(built, head_block):
    target, out = built
    reqs = _reqs(3, params=lambda i: SamplingParams(0.8, top_p=0.9, seed=7 + i))
    _, call, meta, _ = _services(out)
    drafter = RemoteDrafter(call, meta, 3, head_block=head_block)
    eng = Batcher(RemoteTarget(call, TINY.vocab_size, 3, 96), drafter, SPS, None, 3)
    sinks = [Collect() for _ in reqs]
    for r, s in zip(reqs, sinks):
        eng.submit(r, "static:4", s)
    eng.run_until_idle(500)
    direct = Batcher(
        OrtTargetRunner(session(out / "target.opt.onnx", 1), TINY, 3, 96),
        OrtDrafterRunner.load(out, 3, 1),
        SPS,
    )
    sinks2 = [Collect() for _ in reqs]
    for r, s in zip(reqs, sinks2):
        direct.submit(r, "static:4", s)
    direct.run_until_idle(500)
    assert [s.out for s in sinks] == [s.out for s in sinks2]


def _step_inputs(ids, keep, rows, **extra):
    return {
        "seq_ids": np.array(ids, np.int64),
        "keep_len": np.array(keep, np.int64),
        "tokens": np.array([t for r in rows for t in r], np.int64),
        "n_tokens": np.array([len(r) for r in rows], np.int64),
        **extra,
    }


def test_target_service_rejects_bad_requests_without_leaking_slots(built):
    _, out = built
    svcs, _, _, _ = _services(out, slots=2)
    t = svcs["target"]
    cases = [
        ({"keep_len": np.zeros(1, np.int64)}, "missing input 'seq_ids'"),
        (_step_inputs([1], [0], [[TINY.vocab_size]]), r"token ids must be in \[0, 61\)"),
        (_step_inputs([1], [0], [[-1]]), "token ids"),
        ({**_step_inputs([1], [0], [[1]]), "tokens": np.array([1.0], np.float32)}, "must be int64"),
        ({**_step_inputs([1], [0], [[1, 2]]), "n_tokens": np.array([3], np.int64)}, "counts sum to 3"),
        (_step_inputs([1, 1], [0, 0], [[1], [2]]), "distinct"),
        (_step_inputs([5], [4], [[1]]), "unknown"),
        (_step_inputs([1, 2], [0, 0], [[1], []]), "at least one token"),
        (_step_inputs([1], [0], [list(range(1, 61)) * 2]), "96"),  # longer than the KV slots
    ]
    for inputs, msg in cases:
        with pytest.raises((RequestError, ValueError), match=msg):
            t.handle(inputs)
        assert t.active == 0 and t.runner.free_slots == 2
    res = t.handle(_step_inputs([1, 2], [0, 0], [[1, 2, 3], [4]]))
    assert res["logits"].shape == (2, 3, TINY.vocab_size) and res["features"].shape == (4, TINY.feature_size)
    assert res["lengths"].tolist() == [3, 1]
    with pytest.raises(RuntimeError, match="slots are in use"):
        t.handle(_step_inputs([3], [0], [[1]]))
    assert t.active == 2
    res = t.handle(_step_inputs([1], [2], [[9]], last_only=np.array([True])))  # rollback + step
    assert res["lengths"].tolist() == [3] and res["logits"].shape == (1, 1, TINY.vocab_size)
    t.handle({"release_ids": np.array([1, 2, 77], np.int64)})
    assert t.active == 0 and t.runner.free_slots == 2


def test_probe_entry_leaves_sequences_alone(built):
    _, out = built
    svcs, _, _, _ = _services(out, slots=2)
    t = svcs["target"]
    t.handle(_step_inputs([1], [0], [[1, 2, 3]]))
    a = t.handle({"probe_tokens": np.ones((2, 4), np.int64), "probe_context": np.array([20], np.int64)})
    b = t.handle({"probe_tokens": np.ones((2, 4), np.int64), "probe_context": np.array([20], np.int64)})
    assert a["probe_argmax"].shape == (2, 4) and np.array_equal(a["probe_argmax"], b["probe_argmax"])
    assert t.active == 1 and t.runner.length(t.slot_of[1]) == 3
    with pytest.raises(RequestError, match="probe_tokens"):
        t.handle({"probe_tokens": np.full((1, 2), 99, np.int64), "probe_context": np.array([20], np.int64)})


def test_backbone_service_rejects_bad_requests_and_releases(built):
    _, out = built
    svcs, _, meta, _ = _services(out, slots=2)
    b = svcs["drafter_backbone"]
    F = TINY.feature_size
    good = {
        "seq_ids": np.array([1], np.int64),
        "anchor_ids": np.array([3], np.int64),
        "features": np.zeros((5, F), np.float32),
        "n_features": np.array([5], np.int64),
    }
    with pytest.raises(RequestError, match="anchor_ids must be in"):
        b.handle({**good, "anchor_ids": np.array([999], np.int64)})
    with pytest.raises(RequestError, match="counts sum to 4"):
        b.handle({**good, "n_features": np.array([4], np.int64)})
    with pytest.raises(ValueError, match="max_context"):
        b.handle({**good, "features": np.zeros((80, F), np.float32), "n_features": np.array([80], np.int64)})
    assert not b.known and b.drafter.free_slots == 2
    res = b.handle(good)
    assert res["base_logits"].shape == (1, meta["config"]["block_size"], len(meta["draft_vocab"]))
    b.handle({"release_ids": np.array([1], np.int64)})
    assert not b.known and b.drafter.free_slots == 2


def test_head_block_entry_equals_the_step_entry_with_sampling_in_the_orchestrator(built):
    """The block entry runs the same sample_block as the orchestrator would around γ step calls:
    same draft indices, same q, same confidences, for greedy, temperature, top-k and top-p rows."""
    _, out = built
    svcs, call, meta, _ = _services(out, slots=4)
    head = svcs["drafter_head"]
    G, Vd = meta["config"]["block_size"], len(meta["draft_vocab"])
    res = svcs["drafter_backbone"].handle(
        {
            "seq_ids": np.arange(4, dtype=np.int64),
            "anchor_ids": np.array([3, 9, 17, 40], np.int64),
            "features": np.random.default_rng(0).standard_normal((12, TINY.feature_size)).astype(np.float32),
            "n_features": np.array([3, 3, 3, 3], np.int64),
        }
    )
    U, h = res["base_logits"], res["hidden"]
    assert U.shape[:2] == (4, G) and h.shape[:2] == (4, G)
    params = [
        SamplingParams(),
        SamplingParams(0.7),
        SamplingParams(1.0, top_k=5),
        SamplingParams(1.3, top_p=0.8),
    ]
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    step_path = RemoteDrafter(call, meta, 4, head_block=False)
    _, _, to_draft = draft_vocabulary(meta)
    prev = torch.from_numpy(to_draft[np.array([3, 9, 17, 40])])
    want = sample_block(step_path._head_step, torch.from_numpy(U), torch.from_numpy(h), prev,
                        step_path.draft_vocab, step_path.vocab_size, params, gens)  # fmt: skip
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    got = RemoteDrafter(call, meta, 4)._head_block(U, h, prev, params, gens)
    assert torch.equal(got.index, want.index) and torch.equal(got.tokens, want.tokens)
    assert torch.equal(got.probs, want.probs) and torch.equal(got.conf_logits, want.conf_logits)
    assert got.probs.shape == (4, G, Vd) and got.index[0].tolist() == got.probs[0].argmax(-1).tolist()

    block = {"block_logits": U, "block_hidden": h, "prev": prev.numpy(), "uniforms": np.full((4, G), 0.5),
             "temperature": np.zeros(4), "top_k": np.zeros(4, np.int64), "top_p": np.ones(4)}  # fmt: skip
    bad = [
        ({"uniforms": np.full((4, G), 1.0)}, r"uniforms must be in \[0, 1\)"),
        ({"uniforms": np.full((3, G), 0.5)}, "must agree"),
        ({"temperature": np.full(4, -1.0)}, "temperature must be"),
        ({"top_p": np.zeros(4)}, "top_p must be"),
        ({"top_k": np.zeros(3, np.int64)}, "one entry per row"),
        ({"prev": np.full(4, Vd + 1, np.int64)}, "draft-vocabulary indices"),
        ({"uniforms": np.full((4, G), 0.5, np.float32)}, "must be float64"),
    ]
    for change, msg in bad:
        with pytest.raises(RequestError, match=msg):
            head.handle({**block, **change})


def test_a_request_that_never_drafted_costs_no_release_call(built):
    """dspark-skip under a prohibitive draft price: most requests never draft, and ending them
    makes no call to the backbone model (it never held their context); the ones that drafted are
    released. Tokens equal the target alone; every slot is free at the end."""
    from tests.unit.test_engine import _FixedPrice

    target, out = built
    svcs, call, meta, calls = _services(out)
    reqs = _reqs(5)
    plain = [r.tokens for r in generate(TargetRunner(target, 5, 96), reqs)]
    eng = Batcher(RemoteTarget(call, TINY.vocab_size, 3, 96), RemoteDrafter(call, meta, 3), SPS, None, 3)
    eng.draft_cost = _FixedPrice(1e6)
    sinks = [Collect() for _ in reqs]
    for r, s in zip(reqs, sinks):
        eng.submit(r, "dspark-skip", s)
    eng.run_until_idle(500)
    assert [s.out for s in sinks] == plain
    drafted = sum(1 for s in sinks if s.result.trace)
    assert 1 <= drafted < len(reqs)
    assert calls.count("drafter_backbone:release") == drafted
    assert svcs["target"].active == 0 and not svcs["drafter_backbone"].known
    assert svcs["drafter_backbone"].drafter.free_slots == 3


def test_catchup_positions_predict_what_the_backbone_feeds(built):
    """dspark-skip prices a draft by each request's `catchup_positions` (issue 18): over begin /
    advance / propose in random order, the prediction equals the positions the backbone model then
    feeds through its context pass (its running total), and a request that drafted owes nothing."""
    from dspark.core.sampling import make_generator

    _, out = built
    svcs, call, meta, _ = _services(out)
    d = RemoteDrafter(call, meta, 3)
    rng = np.random.default_rng(0)
    F = meta["config"]["feature_size"]

    def feats(n: int) -> torch.Tensor:
        return torch.from_numpy(rng.standard_normal((n, F)).astype(np.float32))

    d.begin(1, [], feats(6))
    d.begin(2, [], feats(2))
    fed = 0
    for step in range(12):
        for rid in (1, 2):
            d.advance(rid, [], feats(int(rng.integers(1, 4))))
        rids = [r for r in (1, 2) if rng.random() < 0.4] or [1 + step % 2]
        owed = sum(d.catchup_positions(r) for r in rids)
        for r in (1, 2):  # a request's first draft feeds everything through the context pass
            waiting = sum(map(len, d.pending[r]))
            assert d.catchup_positions(r) == (max(0, waiting - d.new_positions) if r in d.known else waiting)
        d.propose(rids, [3] * len(rids), [SamplingParams()] * len(rids), [make_generator(r) for r in rids])
        fed_now = d.catchup_totals()[0]
        assert fed_now - fed == owed
        fed = fed_now
        assert all(d.catchup_positions(r) == 0 for r in rids)
    d.end(1)
    d.end(2)
    assert not svcs["drafter_backbone"].known
