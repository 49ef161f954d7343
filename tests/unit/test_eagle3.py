"""The EAGLE-3 drafter: training-time test = runtime, masks, lossless greedy, loss, training, checkpoints."""

import math

import pytest
import torch

from dspark.core.interfaces import Request
from dspark.core.reference import generate
from dspark.core.sampling import SamplingParams, sample, uniforms
from dspark.core.scheduler import policy_for
from dspark.models.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Runner
from dspark.models.loading import LoadedTarget
from dspark.models.losses import Sequence, make_blocks
from dspark.models.target import TargetRunner
from dspark.training.data import Prompt, regenerate
from dspark.training.train import TrainConfig, train
from tests.conftest import TINY, tiny_target
from tests.unit.test_data import CharTokenizer

GAMMA = 7
VOCAB = torch.tensor([0] + list(range(2, TINY.vocab_size, 2)))  # a subset: even ids and the stop id 0


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tensors here are tiny: one intra-op thread (conftest's two spin-wait on a busy 2-core box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _drafter(seed=0, target=None, num_layers=1):
    """A float64 drafter with weights of unit-scale activations, so attention is far from uniform
    and every dependency shows in the logits."""
    target = target or tiny_target()
    cfg = Eagle3Config.for_target(TINY, len(VOCAB), block_size=GAMMA, num_layers=num_layers)
    m = Eagle3Drafter(cfg, VOCAB).to(torch.float64).init_weights(seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, 1.0 / math.sqrt(p.shape[1]), generator=g)
    return m.attach(target.model.embed_tokens.weight, target.lm_head.weight)


def _feats(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, TINY.feature_size, generator=g, dtype=torch.float64)


def _ttt_probs(m, feats, tokens, drafts):
    """Training-time distributions of the chain anchored at the last token, teacher-forced on drafts."""
    a = len(tokens) - 1
    prev = torch.tensor([tokens[-1]] + drafts[:-1]).unsqueeze(0)
    with torch.no_grad():
        z = m.ttt_logits(feats, torch.tensor(tokens), torch.tensor([a]), prev)
    return torch.softmax(z[0], -1)


@pytest.mark.parametrize("num_layers", [1, 2])
def test_training_time_chains_equal_the_runtime_proposals_across_rounds(num_layers):
    m = _drafter(num_layers=num_layers)
    runner = Eagle3Runner(m, num_slots=3, max_len=64)
    prompts = {0: [3, 8, 13, 21, 34, 55], 1: [7, 1, 4, 1, 5, 9, 2, 6, 5]}
    feats = {r: _feats(len(p), seed=r) for r, p in prompts.items()}
    tokens = {r: list(p) for r, p in prompts.items()}
    for r in prompts:
        runner.begin(r, tokens[r], feats[r])
    params = [SamplingParams(temperature=1.0)] * 2
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    accepted = {0: 2, 1: 0}
    for anchors in ([10, 33], [17, 40]):  # odd anchors lie outside the draft vocabulary
        prop = runner.propose([0, 1], anchors, params, gens)
        for r, a in enumerate(anchors):
            drafts = prop.tokens[r].tolist()
            assert set(drafts) <= set(VOCAB.tolist())
            q = _ttt_probs(m, feats[r], tokens[r] + [a], drafts)
            assert torch.allclose(prop.probs[r][:, VOCAB].double(), q, atol=1e-5)
            outside = torch.ones(TINY.vocab_size, dtype=torch.bool)
            outside[VOCAB] = False
            assert prop.probs[r][:, outside].abs().max() == 0
            assert (prop.probs[r][torch.arange(GAMMA), prop.tokens[r]] > 0).all()
            committed = [a] + drafts[: accepted[r]]
            new = _feats(len(committed), seed=10 + r + a)
            runner.advance(r, committed, new)
            tokens[r] += committed
            feats[r] = torch.cat([feats[r], new])
    assert torch.equal(prop.conf_logits, torch.zeros(2, GAMMA))


def test_drafts_are_inverse_cdf_samples_of_q_from_exactly_gamma_uniforms():
    m = _drafter()
    runner = Eagle3Runner(m, num_slots=1, max_len=32)
    runner.begin(0, [3, 8, 13], _feats(3, seed=0))
    gen, ref = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    prop = runner.propose([0], [10], [SamplingParams(temperature=0.7, top_k=5)], [gen])
    us = uniforms(ref, GAMMA)
    for k in range(GAMMA):
        assert int(prop.tokens[0, k]) == int(VOCAB[sample(prop.probs[0, k, VOCAB], us[k])])
        assert int((prop.probs[0, k] > 0).sum()) <= 5  # top-k applied over the draft vocabulary
    assert torch.equal(torch.rand(3, generator=gen), torch.rand(3, generator=ref))


def test_proposing_again_without_advance_repeats_the_proposal():
    runner = Eagle3Runner(_drafter(), num_slots=1, max_len=32)
    runner.begin(0, [3, 8, 13], _feats(3, seed=0))
    props = [
        runner.propose([0], [10], [SamplingParams(temperature=1.0)], [torch.Generator().manual_seed(5)])
        for _ in range(2)
    ]
    assert torch.equal(props[0].tokens, props[1].tokens) and torch.equal(props[0].probs, props[1].probs)


def test_a_context_of_max_len_positions_still_proposes_and_one_more_is_refused():
    m = _drafter()
    runner = Eagle3Runner(m, num_slots=1, max_len=8)
    tokens, feats = [3, 8, 13, 21, 34, 55, 1, 4], _feats(8, seed=0)
    runner.begin(0, tokens, feats)
    prop = runner.propose([0], [12], [SamplingParams(temperature=1.0)], [torch.Generator().manual_seed(0)])
    q = _ttt_probs(m, feats, tokens + [12], prop.tokens[0].tolist())
    assert torch.allclose(prop.probs[0][:, VOCAB].double(), q, atol=1e-5)
    with pytest.raises(ValueError, match="raise max_len"):
        runner.advance(0, [12], _feats(1, seed=1))


@pytest.mark.parametrize("num_layers", [1, 2])
def test_a_chain_sees_features_up_to_its_anchor_minus_one_and_never_other_chains(num_layers):
    m = _drafter(num_layers=num_layers)
    T = 12
    feats = _feats(T, seed=0)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, TINY.vocab_size, (T + 1,), generator=g)
    anchors = torch.tensor([5, 9])
    prev = torch.randint(0, TINY.vocab_size, (2, GAMMA), generator=g)
    prev[:, 0] = tokens[anchors]

    def logits(f=feats, t=tokens, a=anchors, p=prev):
        with torch.no_grad():
            return m.ttt_logits(f, t, a, p)

    z = logits()
    later = feats.clone()
    later[5:] += 5.0  # positions ≥ a = 5: invisible to the first chain
    assert torch.allclose(logits(f=later)[0], z[0], atol=1e-12)
    assert not torch.allclose(logits(f=later)[1], z[1], atol=1e-6)  # the chain at 9 sees 5..8
    boundary = feats.clone()
    boundary[4] += 5.0  # position a−1 = 4: step 1 of the first chain reads it
    assert not torch.allclose(logits(f=boundary)[0, 0], z[0, 0], atol=1e-6)
    tok2 = tokens.clone()
    tok2[6:] = (tok2[6:] + 1) % TINY.vocab_size  # x_{t+1} of positions t ≥ 5
    assert torch.allclose(logits(t=tok2)[0], z[0], atol=1e-12)
    prev2 = prev.clone()
    prev2[:, 3] = (prev2[:, 3] + 1) % TINY.vocab_size  # the token fed at step 4 (slot 3)
    z2 = logits(p=prev2)
    assert torch.allclose(z2[:, :3], z[:, :3], atol=1e-12)
    assert not torch.allclose(z2[:, 3], z[:, 3], atol=1e-6)
    for b in range(2):  # chains never see each other
        assert torch.allclose(logits(a=anchors[b : b + 1], p=prev[b : b + 1])[0], z[b], atol=1e-12)


def _copying(m):
    """Mostly copies its input token: the tiny target repeats tokens a lot, so its drafts are often
    accepted (whole blocks and partial ones), unlike a random drafter's."""
    d = TINY.hidden_size
    with torch.no_grad():
        m.fc.weight[:, :d] = torch.eye(d, dtype=m.fc.weight.dtype)
        m.fc.weight[:, d:] *= 0.1
        for layer in m.layers:
            layer.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
    return m


@pytest.mark.parametrize("drafter", ["random", "copying"])
def test_greedy_with_an_eagle3_drafter_equals_target_greedy(drafter):
    target = tiny_target(seed=3)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, TINY.vocab_size, (n,), generator=g).tolist() for n in (4, 11, 7)]
    reqs = [Request(p, max_tokens=20, stop_ids=frozenset({0})) for p in prompts]
    plain = [r.tokens for r in generate(TargetRunner(target, 4, 64), reqs)]
    m = _drafter(target=target)
    spec = generate(
        TargetRunner(target, 4, 64),
        reqs,
        drafter=Eagle3Runner(_copying(m) if drafter == "copying" else m, 4, 64),
        policy=policy_for(f"static:{GAMMA}"),
    )
    assert [r.tokens for r in spec] == plain
    assert any(t % 2 == 1 and t != 0 for toks in plain for t in toks), "no out-of-subset token was tested"
    if drafter == "copying":
        accepted_at = sum(r.stats.accepted_at for r in spec)
        assert accepted_at[-1] > 0 and accepted_at[0] > accepted_at[-1]  # full and partial blocks


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
    loaded, files = _tiny_cache(tmp_path, n=1, max_new=16)
    m = _drafter(target=loaded.model)
    seq = Sequence.load(files[0])
    blocks = make_blocks(seq, 6, GAMMA, torch.Generator().manual_seed(0))
    out = m.loss(seq, blocks)
    runner = TargetRunner(loaded.model, 1, 128)
    logits = runner.step([runner.allocate()], [seq.tokens[:-1].tolist()]).logits[0]
    w = 0.8 ** torch.arange(GAMMA, dtype=torch.float64)  # per-step TTT weights (reference notes §2.5)
    ce = tv = den = 0.0
    T = len(seq.tokens)
    for a in blocks.anchors.tolist():
        tokens = seq.tokens[: a + 1].tolist()
        drafts = seq.tokens[a + 1 : a + GAMMA + 1].tolist()
        drafts += [0] * (GAMMA - len(drafts))
        q = _ttt_probs(m, seq.features[:a], tokens, drafts)
        for k in range(GAMMA):
            if a + k + 1 > T - 1:
                break
            pt = torch.softmax(logits[a + k].double(), -1)
            pd = torch.zeros(TINY.vocab_size, dtype=torch.float64)
            pd[VOCAB] = q[k]
            ce += float(w[k] * -(pt[VOCAB] * torch.log(q[k])).sum())
            tv += float(w[k] * (pd - pt).abs().sum())
            den += float(w[k])
    # the cache stores fp16 features and hidden states: allow for that rounding
    assert out.ce == pytest.approx(ce / den, rel=2e-3)
    assert float(out.total.detach()) == pytest.approx(ce / den, rel=2e-3)
    assert out.tv == pytest.approx(tv / den, rel=2e-3)
    assert out.conf == 0.0
    assert torch.equal(out.count, blocks.valid.sum(0).float())


def test_training_reduces_the_loss_and_checkpoints_round_trip(tmp_path):
    loaded, files = _tiny_cache(tmp_path, n=6, max_new=24)
    embed, head = loaded.model.model.embed_tokens.weight, loaded.model.lm_head.weight
    full = torch.arange(TINY.vocab_size)  # EAGLE-3 as configured: the full vocabulary
    cfg = Eagle3Config.for_target(TINY, len(full), block_size=GAMMA)
    m = Eagle3Drafter(cfg, full).init_weights(0).attach(embed, head)
    seqs = [Sequence.load(f) for f in files]
    gen = torch.Generator().manual_seed(1)
    fixed = [(s, make_blocks(s, 16, GAMMA, gen)) for s in seqs]

    def eval_loss():
        with torch.no_grad():
            outs = [m.loss(s, b) for s, b in fixed]
        return sum(float(o.total) for o in outs) / len(outs), sum(o.tv for o in outs) / len(outs)

    before = eval_loss()
    tc = TrainConfig(steps=30, seqs_per_step=3, anchors_per_seq=16, lr=3e-3, log_every=10, ckpt_every=15)
    summary = train(m, files, tc, tmp_path / "run", log=lambda *_: None)
    after = eval_loss()
    assert after[0] < 0.6 * before[0] and after[1] < 0.6 * before[1]  # soft CE and ‖p^d − p^t‖_1
    assert summary["steps"] == 30 and len(summary["history"]) == 3
    m.save(tmp_path / "ckpt", extra={"summary": summary})
    m16 = Eagle3Drafter.load(tmp_path / "ckpt")  # identical to rounding m to fp16
    assert m16.cfg == m.cfg
    for (n1, p1), (n2, p2) in zip(m.state_dict().items(), m16.state_dict().items()):
        assert n1 == n2
        assert torch.equal(p1.half().float(), p2) if p1.is_floating_point() else torch.equal(p1, p2)
    m16.attach(embed, head)
    s, b = fixed[0]
    with torch.no_grad():
        assert float(m16.loss(s, b).total) == pytest.approx(float(m.loss(s, b).total), rel=2e-2)
