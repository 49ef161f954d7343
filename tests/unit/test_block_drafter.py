"""The block drafter: attention structure, Markov/RNN heads, losses, training, checkpoints."""

import numpy as np
import pytest
import torch

from dspark.core.interfaces import Request
from dspark.core.reference import generate
from dspark.core.sampling import SamplingParams
from dspark.core.scheduler import policy_for
from dspark.models.block_drafter import BlockDrafter, BlockDrafterRunner, DrafterConfig
from dspark.models.loading import LoadedTarget
from dspark.models.losses import Sequence, block_loss, make_blocks, position_weights
from dspark.models.target import TargetRunner
from dspark.training.data import Prompt, regenerate
from dspark.training.train import TrainConfig, train
from tests.conftest import TINY, tiny_target
from tests.unit.test_data import CharTokenizer

GAMMA = 4
VOCAB = torch.tensor([0] + list(range(2, TINY.vocab_size, 2)))  # a subset: even ids and the stop id 0


def _drafter(kind="dspark", head="markov", seed=0, target=None):
    target = target or tiny_target()
    extra = {} if kind == "dflash" else {"head": head, "markov_rank": 8}
    cfg = DrafterConfig.for_target(TINY, kind, len(VOCAB), block_size=GAMMA, num_layers=2, **extra)
    m = BlockDrafter(cfg, VOCAB).to(torch.float64).init_weights(seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():  # non-zero Markov/RNN weights so the heads matter in these tests
        for name, p in m.named_parameters():
            if name.startswith(("w2", "rnn", "conf")):
                p.normal_(0, 0.3, generator=g)
    return m.attach(target.model.embed_tokens.weight, target.lm_head.weight)


def _ctx(m, n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(1, n, TINY.feature_size, generator=g, dtype=torch.float64)
    return feats, m.context_kv(m.project_context(feats), torch.arange(n).unsqueeze(0))


def test_block_queries_see_only_context_before_the_anchor_and_their_own_block():
    m = _drafter()
    feats, kv = _ctx(m)
    anchors, p0 = torch.tensor([5, 9]), torch.tensor([6, 9])
    ok = torch.arange(12).unsqueeze(0) < p0.unsqueeze(1)
    U, h = m.backbone(anchors, p0, kv, ok)
    # changing context at or after an anchor's position changes nothing for that block
    f2 = feats.clone()
    f2[0, 6:] += 5.0
    kv2 = m.context_kv(m.project_context(f2), torch.arange(12).unsqueeze(0))
    U2, _ = m.backbone(anchors, p0, kv2, ok)
    assert torch.allclose(U2[0], U[0], atol=1e-12)
    assert not torch.allclose(U2[1], U[1], atol=1e-6)  # the second block (p0 = 9) saw positions 6..8
    # blocks never see each other: each block alone gives the same output
    for b in range(2):
        Ub, _ = m.backbone(anchors[b : b + 1], p0[b : b + 1], kv, ok[b : b + 1])
        assert torch.allclose(Ub[0], U[b], atol=1e-12)


@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_teacher_forced_head_equals_the_sequential_sampling_loop(head):
    m = _drafter(head=head)
    feats = torch.randn(9, TINY.feature_size, dtype=torch.float64)
    runner = BlockDrafterRunner(m, num_slots=2, max_len=64)
    runner.begin(0, list(range(9)), feats)
    gen = torch.Generator().manual_seed(3)
    prop = runner.propose([0], [7], [SamplingParams(temperature=1.0)], [gen])
    assert set(prop.tokens[0].tolist()) <= set(VOCAB.tolist())
    kv = m.context_kv(m.project_context(feats.unsqueeze(0)), torch.arange(9).unsqueeze(0))
    U, h = m.backbone(torch.tensor([7]), torch.tensor([9]), kv, torch.ones(1, 9, dtype=torch.bool))
    prev = torch.cat([torch.tensor([7]), prop.tokens[0, :-1]]).unsqueeze(0)
    z, conf = m.teacher_forced(U, h, m.to_draft[prev])
    q = torch.softmax(z[0], -1)
    dense = prop.dense_probs(TINY.vocab_size)
    assert torch.allclose(dense[0][:, VOCAB].double(), q, atol=1e-6)
    assert dense[0].sum(-1).allclose(torch.ones(GAMMA, dtype=torch.float32), atol=1e-5)
    assert torch.equal(prop.vocab[prop.index], prop.tokens)
    assert torch.allclose(prop.conf_logits[0].double(), conf[0], atol=1e-5)


def _tiny_cache(tmp_path, n=6, max_new=20):
    loaded = LoadedTarget(tiny_target(seed=5), CharTokenizer(), "tiny")
    prompts = [Prompt("p", i, f"tell me about {i} things" * (1 + i % 2)) for i in range(n)]
    regenerate(
        loaded,
        prompts,
        tmp_path / "a.jsonl",
        cache_dir=tmp_path / "cache",
        batch=3,
        max_new_tokens=max_new,
        params=SamplingParams(temperature=1.0),
    )
    return loaded, sorted((tmp_path / "cache").glob("*.npz"))


def test_loss_matches_a_brute_force_computation(tmp_path):
    loaded, files = _tiny_cache(tmp_path, n=2)
    m = _drafter(target=loaded.model)
    seq = Sequence.load(files[0])
    blocks = make_blocks(seq, 5, GAMMA, torch.Generator().manual_seed(0))
    out = block_loss(m, seq, blocks)
    # brute force: full-vocabulary target softmax from a fresh forward, loops over blocks/slots
    runner = TargetRunner(loaded.model, 1, 128)
    logits = runner.step([runner.allocate()], [seq.tokens[:-1].tolist()]).logits[0]
    n_ctx = len(seq.features)
    kv = m.context_kv(m.project_context(seq.features.unsqueeze(0)), torch.arange(n_ctx).unsqueeze(0))
    w = position_weights(GAMMA)
    num = {"ce": 0.0, "tv": 0.0, "conf": 0.0}
    den = 0.0
    for b in range(len(blocks.anchors)):
        a = int(blocks.anchors[b])
        ok = torch.arange(n_ctx).unsqueeze(0) < a
        U, h = m.backbone(seq.tokens[a : a + 1], torch.tensor([a]), kv, ok)
        prev, state = m.to_draft[seq.tokens[a : a + 1]], None
        for k in range(GAMMA):
            if a + k + 1 > len(seq.tokens) - 1:
                break
            z, c, state = m.head_step(U[:, k], h[:, k], prev, state)
            pd = torch.zeros(TINY.vocab_size, dtype=torch.float64)
            pd[VOCAB] = torch.softmax(z[0].double(), -1)
            pt = torch.softmax(logits[a + k].double(), -1)
            l1 = (pd - pt).abs().sum()
            label = int(seq.tokens[a + k + 1])
            if label in VOCAB.tolist():
                num["ce"] += float(w[k] * -torch.log(pd[label].detach()))
            num["tv"] += float(w[k] * l1.detach())
            target = float((1 - 0.5 * l1.detach()).clamp(0, 1))
            sig = torch.sigmoid(c[0].detach().double())
            num["conf"] += float(w[k] * -(target * torch.log(sig) + (1 - target) * torch.log(1 - sig)))
            den += float(w[k])
            prev = m.to_draft[seq.tokens[a + k + 1 : a + k + 2]]
    # the cache stores fp16 hidden states: allow for that rounding
    assert out.ce == pytest.approx(num["ce"] / den, rel=2e-3)
    assert out.tv == pytest.approx(num["tv"] / den, rel=2e-3)
    assert out.conf == pytest.approx(num["conf"] / den, rel=2e-3)
    total = 0.1 * num["ce"] / den + 0.9 * num["tv"] / den + num["conf"] / den
    assert float(out.total) == pytest.approx(total, rel=2e-3)


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_training_reduces_the_loss_and_checkpoints_round_trip(tmp_path, kind):
    loaded, files = _tiny_cache(tmp_path, n=6, max_new=24)
    m = _drafter(kind, target=loaded.model).float()
    m.attach(loaded.model.model.embed_tokens.weight, loaded.model.lm_head.weight)
    seqs = [Sequence.load(f) for f in files]
    gen = torch.Generator().manual_seed(1)
    fixed = [(s, make_blocks(s, 16, GAMMA, gen)) for s in seqs]

    def eval_loss():
        with torch.no_grad():
            return sum(float(block_loss(m, s, b).total) for s, b in fixed) / len(fixed)

    before = eval_loss()
    tc = TrainConfig(steps=30, seqs_per_step=3, anchors_per_seq=16, lr=3e-3, log_every=10, ckpt_every=15)
    summary = train(m, files, tc, tmp_path / "run", log=lambda *_: None)
    after = eval_loss()
    assert after < 0.8 * before
    assert summary["steps"] == 30 and len(summary["history"]) == 3
    m.save(tmp_path / "ckpt", extra={"summary": summary})
    m2 = BlockDrafter.load(tmp_path / "ckpt").attach(
        loaded.model.model.embed_tokens.weight, loaded.model.lm_head.weight
    )
    m16 = BlockDrafter.load(tmp_path / "ckpt")  # identical to rounding m to fp16
    for (n1, p1), (n2, p2) in zip(m.state_dict().items(), m16.state_dict().items()):
        assert n1 == n2
        if p1.is_floating_point():
            assert torch.equal(p1.half().float(), p2)
    assert m2.cfg == m.cfg


def test_training_resumes_from_its_checkpoint(tmp_path):
    loaded, files = _tiny_cache(tmp_path, n=4, max_new=16)
    tc = TrainConfig(steps=6, seqs_per_step=2, anchors_per_seq=8, lr=1e-3, log_every=2, ckpt_every=3)
    a = (
        _drafter(target=loaded.model)
        .float()
        .attach(loaded.model.model.embed_tokens.weight, loaded.model.lm_head.weight)
    )
    train(a, files, tc, tmp_path / "full", log=lambda *_: None)
    b = (
        _drafter(target=loaded.model)
        .float()
        .attach(loaded.model.model.embed_tokens.weight, loaded.model.lm_head.weight)
    )
    train(b, files, tc, tmp_path / "split", log=lambda *_: None, until=3)  # interrupted
    b = (
        _drafter(target=loaded.model)
        .float()
        .attach(loaded.model.model.embed_tokens.weight, loaded.model.lm_head.weight)
    )
    train(b, files, tc, tmp_path / "split", log=lambda *_: None)  # resumes at step 3
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


@pytest.mark.parametrize("mode", ["static:4", "dspark"])
def test_greedy_with_a_vocabulary_subset_drafter_equals_target_greedy(mode):
    from dspark.core.sps import SPSTable

    target = tiny_target(seed=3)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, TINY.vocab_size, (n,), generator=g).tolist() for n in (4, 11, 7)]
    reqs = [Request(p, max_tokens=20, stop_ids=frozenset({0})) for p in prompts]
    plain = [r.tokens for r in generate(TargetRunner(target, 4, 64), reqs)]
    m = _drafter(target=target)
    sps = SPSTable.from_step_times([1, 64], [1.0, 1.0 + 0.05 * 63])
    spec = generate(
        TargetRunner(target, 4, 64),
        reqs,
        drafter=BlockDrafterRunner(m, 4, 64),
        policy=policy_for(mode, sps),
    )
    assert [r.tokens for r in spec] == plain
    assert any(t % 2 == 1 and t != 0 for toks in plain for t in toks), "no out-of-subset token was tested"


def test_sampling_with_a_vocabulary_subset_drafter_is_lossless():
    """q is zero outside the draft vocabulary; the residual restores the target's mass there.
    Exact law of the first speculative token (generated token 2) by enumerating token 1."""
    from scipy.stats import chisquare

    target = tiny_target(seed=3)
    prompt = [5, 17, 33]
    with torch.no_grad():
        r = TargetRunner(target, TINY.vocab_size, 8)
        slots = [r.allocate() for _ in range(TINY.vocab_size)]
        p1 = torch.softmax(r.step([slots[0]], [prompt]).logits[0, -1].double(), -1)
        r2 = TargetRunner(target, TINY.vocab_size, 8)
        s2 = [r2.allocate() for _ in range(TINY.vocab_size)]
        p2 = torch.softmax(
            r2.step(s2, [prompt + [t] for t in range(TINY.vocab_size)]).logits[:, -1].double(), -1
        )
    law = (p1.unsqueeze(1) * p2).sum(0).numpy()
    m = _drafter(target=target)
    drafter = BlockDrafterRunner(m, 8, 32)
    counts = np.zeros(TINY.vocab_size)
    n, batch = 2000, 8
    for b in range(n // batch):
        reqs = [
            Request(prompt, max_tokens=3, params=SamplingParams(1.0, seed=b * batch + i))
            for i in range(batch)
        ]
        for res in generate(
            TargetRunner(target, batch, 16), reqs, drafter=drafter, policy=policy_for("static:2")
        ):
            counts[res.tokens[1]] += 1
    big = law * n >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(law[big], law[~big].sum()) * n
    assert chisquare(obs, exp / exp.sum() * obs.sum()).pvalue > 1e-3
    odd_mass = law[1::2].sum()
    assert odd_mass > 0.1, "the test needs target mass outside the draft vocabulary"


def test_draft_vocabulary_is_frequency_ranked_and_keeps_stop_tokens():
    from dspark.training.train import build_draft_vocab

    vocab, coverage = build_draft_vocab([[5, 5, 5, 7, 7, 9], [5, 7, 11]], size=3, must_include=[2])
    assert vocab.tolist() == [2, 5, 7]
    assert coverage == pytest.approx(7 / 9)


def test_sample_block_greedy_rows_at_once_equal_the_per_row_warp_and_sample():
    """sample_block handles greedy rows in one argmax; it must pick exactly what warp + sample
    pick row by row (ties included: both take the first maximum), next to sampled rows."""
    from dspark.core.sampling import SamplingParams, sample, warp
    from dspark.models.block_drafter import block_uniforms, sample_block

    R, G, Vd = 6, 5, 23
    g = torch.Generator().manual_seed(5)
    U = torch.randint(-3, 4, (R, G, Vd), generator=g).float()  # small integers: many ties
    h = torch.zeros(R, G, 2)
    params = [SamplingParams(), SamplingParams(0.9, seed=1), SamplingParams(), SamplingParams(1.0, top_k=3),
              SamplingParams(), SamplingParams(1.2, top_p=0.7)]  # fmt: skip

    def head_step(U_k, h_k, prev, state):  # a Markov-like head: the previous draft shifts the logits
        return U_k + (prev.float() % 3).unsqueeze(-1), prev.float(), state

    vocab = torch.arange(100, 100 + Vd)
    prop = sample_block(head_step, U, h, torch.zeros(R, dtype=torch.long), vocab, 200, params,
                        [torch.Generator().manual_seed(i) for i in range(R)])  # fmt: skip
    us = block_uniforms([torch.Generator().manual_seed(i) for i in range(R)], G)
    prev = torch.zeros(R, dtype=torch.long)
    for k in range(G):
        z, _, _ = head_step(U[:, k], h[:, k], prev, None)
        for r in range(R):
            q = warp(z[r], params[r])
            assert torch.equal(prop.probs[r, k], q)
            assert int(prop.index[r, k]) == int(sample(q, us[r, k]))
        prev = prop.index[:, k]
    assert torch.equal(prop.tokens, vocab[prop.index])
