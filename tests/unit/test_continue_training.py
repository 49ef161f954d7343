"""Issue 12: training continues from a shipped (fp16) drafter — its weights, its vocabulary, its lineage."""

import json

import pytest
import torch

from dspark.training.pipeline import load_drafter, run_training
from dspark.training.train import TrainConfig
from tests.unit.test_block_drafter import _tiny_cache


def _run(loaded, tmp_path, out, steps, until=None, init_from=None, kind="dspark", vocab=64, grow=None):
    tc = TrainConfig(steps=steps, seqs_per_step=2, anchors_per_seq=8, lr=1e-3, log_every=2, ckpt_every=2)
    return run_training(
        loaded,
        kind,
        tmp_path / "a.jsonl",
        tmp_path / "cache",
        tmp_path / out,
        tc,
        vocab_size=vocab,
        num_layers=1,
        until=until,
        init_from=init_from,
        grow_vocab=grow,
    )


def test_training_continues_from_a_shipped_fp16_drafter(tmp_path):
    loaded, _ = _tiny_cache(tmp_path, n=8, max_new=16)
    first = _run(loaded, tmp_path, "run1", steps=4)
    summary = {k: v for k, v in first["summary"].items() if k != "history"}
    first["model"].save(tmp_path / "ship1", extra={"summary": summary})  # fp16, as shipped

    # zero steps of the continuation: exactly the shipped fp16 weights and vocabulary, in fp32
    shipped, _ = load_drafter(str(tmp_path / "ship1"), loaded)
    start = _run(loaded, tmp_path, "run0", steps=3, until=0, init_from=tmp_path / "ship1")["model"]
    assert torch.equal(start.draft_vocab, first["model"].draft_vocab)
    for (n1, p1), (n2, p2) in zip(start.state_dict().items(), shipped.state_dict().items()):
        assert n1 == n2 and torch.equal(p1.float(), p2.float()), n1
    assert all(p.dtype == torch.float32 for p in start.parameters() if p.is_floating_point())

    second = _run(loaded, tmp_path, "run2", steps=3, init_from=tmp_path / "ship1")
    s = second["summary"]
    assert s["steps"] == 3 and s["total_steps"] == 7
    assert s["continued_from"]["path"] == str(tmp_path / "ship1") and s["continued_from"]["steps"] == 4
    assert s["vocab_size"] == len(first["model"].draft_vocab)
    moved = any(
        not torch.equal(p.float(), q.float())
        for p, q in zip(second["model"].parameters(), shipped.parameters())
    )
    assert moved  # it trained
    json.dumps(s)  # the lineage goes into drafter.json
    listed = (tmp_path / "run2" / "training_files.txt").read_text().split()  # what it trained on
    assert len(listed) == s["training_sequences"] and all(
        (tmp_path / "cache" / f"{k}.npz").exists() for k in listed
    )


def test_continuing_a_drafter_of_another_kind_is_refused(tmp_path):
    loaded, _ = _tiny_cache(tmp_path, n=8, max_new=16)
    first = _run(loaded, tmp_path, "run1", steps=2)
    first["model"].save(tmp_path / "ship1", extra={"summary": {"steps": 2}})
    with pytest.raises(ValueError, match="is a dspark drafter, not dflash"):
        _run(loaded, tmp_path, "run2", steps=2, init_from=tmp_path / "ship1", kind="dflash")


@pytest.mark.parametrize("kind,head", [("dspark", "markov"), ("dspark", "rnn"), ("dflash", None)])
def test_a_grown_drafter_computes_what_it_did_on_its_old_tokens(kind, head):
    from tests.conftest import TINY, tiny_target
    from tests.unit.test_block_drafter import VOCAB, _ctx, _drafter

    target = tiny_target()
    m = _drafter(kind=kind, head=head or "markov", target=target)
    bigger = torch.arange(TINY.vocab_size)  # every id: the odd ones are new
    g = m.grown(bigger).attach(target.model.embed_tokens.weight, target.lm_head.weight)
    assert g.cfg.draft_vocab_size == TINY.vocab_size and torch.equal(g.draft_vocab, bigger)
    old = torch.searchsorted(bigger, VOCAB)  # where each old id sits now
    fresh = torch.ones(len(bigger), dtype=torch.bool)
    fresh[old] = False

    _, kv = _ctx(m)
    anchors, p0 = torch.tensor([5, 9]), torch.tensor([6, 9])
    ok = torch.arange(12).unsqueeze(0) < p0.unsqueeze(1)
    U, h = m.backbone(anchors, p0, kv, ok)
    U2, h2 = g.backbone(anchors, p0, _ctx(g)[1], ok)  # the same features through g
    assert torch.allclose(h2, h, atol=1e-12) and torch.allclose(U2[..., old], U, atol=1e-12)
    prev = torch.tensor([[5, 3, 8, 7], [9, 2, 1, 4]])  # odd ids: outside the old vocabulary
    z, conf = m.teacher_forced(U, h, m.to_draft[prev])
    z2, conf2 = g.teacher_forced(U2, h2, g.to_draft[prev])
    assert torch.allclose(z2[..., old], z, atol=1e-12) and torch.allclose(conf2, conf, atol=1e-12)
    assert torch.equal(z2[..., fresh], U2[..., fresh])  # no Markov/RNN bias on a new id yet


def test_growing_must_keep_every_token_and_needs_a_drafter(tmp_path):
    from tests.unit.test_block_drafter import VOCAB, _drafter

    with pytest.raises(ValueError, match="keep every token"):
        _drafter().grown(VOCAB[1:])
    loaded, _ = _tiny_cache(tmp_path, n=4, max_new=8)
    with pytest.raises(ValueError, match="--init-from"):
        run_training(
            loaded, "dspark", tmp_path / "a.jsonl", tmp_path / "cache", tmp_path / "r", TrainConfig(steps=1),
            vocab_size=64, num_layers=1, grow_vocab=80,
        )  # fmt: skip


def test_training_continues_with_a_grown_vocabulary_and_resumes(tmp_path):
    loaded, _ = _tiny_cache(tmp_path, n=8, max_new=16)
    first = _run(loaded, tmp_path, "run1", steps=2, vocab=6)
    first["model"].save(tmp_path / "ship1", extra={"summary": {"steps": 2}})
    grow = dict(init_from=tmp_path / "ship1", grow=12)
    whole = _run(loaded, tmp_path, "whole", steps=4, **grow)
    s0, s1 = first["summary"], whole["summary"]
    assert s1["vocab_size"] == 12 and s1["vocab_coverage"] > s0["vocab_coverage"]
    assert set(first["model"].draft_vocab.tolist()) <= set(whole["model"].draft_vocab.tolist())
    _run(loaded, tmp_path, "split", steps=4, until=2, **grow)
    split = _run(loaded, tmp_path, "split", steps=4, **grow)  # resumed: same shapes, same result
    for p, q in zip(whole["model"].parameters(), split["model"].parameters()):
        assert torch.allclose(p, q, atol=1e-6)


@pytest.mark.parametrize("kind,head", [("dspark", "markov"), ("dspark", "rnn"), ("dflash", None)])
def test_a_deepened_drafter_computes_what_it_did(kind, head):
    """Item 5 (capacity): new draft layers on top start as the identity, so the deeper drafter's
    backbone, head and confidences equal the old ones; its new layers are copies of the top
    one with the two output projections at zero, and they can learn (non-zero gradients)."""
    from tests.conftest import tiny_target
    from tests.unit.test_block_drafter import _ctx, _drafter

    target = tiny_target()
    m = _drafter(kind=kind, head=head or "markov", target=target)
    with torch.no_grad():  # a top layer whose output projections are not zero, as a trained one's
        for p in m.layers[-1].parameters():
            p.normal_(0, 0.1)
    d = m.deepened(4).attach(target.model.embed_tokens.weight, target.lm_head.weight)
    assert d.cfg.num_layers == 4 and len(d.layers) == 4
    assert torch.equal(d.layers[3].q_proj.weight, m.layers[1].q_proj.weight)
    assert not d.layers[2].o_proj.weight.any() and not d.layers[3].mlp.down_proj.weight.any()
    anchors, p0 = torch.tensor([5, 9]), torch.tensor([6, 9])
    ok = torch.arange(12).unsqueeze(0) < p0.unsqueeze(1)
    U, h = m.backbone(anchors, p0, _ctx(m)[1], ok)
    U2, h2 = d.backbone(anchors, p0, _ctx(d)[1], ok)
    assert torch.allclose(U2, U, atol=1e-12) and torch.allclose(h2, h, atol=1e-12)
    prev = torch.tensor([[4, 2, 8, 6], [0, 2, 10, 4]])
    z, conf = m.teacher_forced(U, h, m.to_draft[prev])
    z2, conf2 = d.teacher_forced(U2, h2, d.to_draft[prev])
    assert torch.allclose(z2, z, atol=1e-12) and torch.allclose(conf2, conf, atol=1e-12)
    U2.square().sum().backward()
    assert (
        d.layers[3].o_proj.weight.grad.abs().sum() > 0
        and d.layers[3].mlp.down_proj.weight.grad.abs().sum() > 0
    )
    with pytest.raises(ValueError, match="cannot be deepened"):
        m.deepened(1)


def test_training_continues_deeper_and_resumes(tmp_path):
    loaded, _ = _tiny_cache(tmp_path, n=8, max_new=16)
    first = _run(loaded, tmp_path, "run1", steps=2)  # one draft layer
    first["model"].save(tmp_path / "ship1", extra={"summary": {"steps": 2}})

    def deeper(out, steps, until=None):
        tc = TrainConfig(steps=steps, seqs_per_step=2, anchors_per_seq=8, lr=1e-3, log_every=2, ckpt_every=2)
        return run_training(
            loaded, "dspark", tmp_path / "a.jsonl", tmp_path / "cache", tmp_path / out, tc,
            vocab_size=64, num_layers=3, until=until, init_from=tmp_path / "ship1",
        )  # fmt: skip

    start = deeper("zero", 2, until=0)["model"]  # before any step: what the shipped drafter computes
    assert start.cfg.num_layers == 3 and not start.layers[2].o_proj.weight.any()
    whole = deeper("whole", 4)
    assert whole["model"].cfg.num_layers == 3 and whole["summary"]["total_steps"] == 6
    assert whole["model"].layers[2].o_proj.weight.any()  # the new layer trained
    deeper("split", 4, until=2)
    split = deeper("split", 4)  # resumed from its checkpoint: same shapes, same result
    for p, q in zip(whole["model"].parameters(), split["model"].parameters()):
        assert torch.allclose(p, q, atol=1e-6)
    shipped = tmp_path / "ship2"
    whole["model"].save(shipped, extra={"summary": {"steps": 4}})
    again, _ = load_drafter(str(shipped), loaded)
    assert again.cfg.num_layers == 3
    shallow = run_training(  # the other way (the small end of item 5): keep its bottom layer
        loaded, "dspark", tmp_path / "a.jsonl", tmp_path / "cache", tmp_path / "shallow",
        TrainConfig(steps=2, seqs_per_step=2, anchors_per_seq=8, lr=1e-3, log_every=2, ckpt_every=2),
        vocab_size=64, num_layers=1, init_from=shipped,
    )["model"]  # fmt: skip
    assert shallow.cfg.num_layers == 1 and len(shallow.layers) == 1


def test_a_truncated_drafter_keeps_its_bottom_layers():
    from tests.conftest import tiny_target
    from tests.unit.test_block_drafter import _drafter

    target = tiny_target()
    m = _drafter(target=target)
    t = m.truncated(1).attach(target.model.embed_tokens.weight, target.lm_head.weight)
    assert t.cfg.num_layers == 1 and len(t.layers) == 1
    kept = dict(t.named_parameters())
    for name, p in m.named_parameters():
        if name.startswith("layers.1."):
            assert name not in kept
        else:
            assert torch.equal(kept[name], p), name
    for bad in (0, 3):
        with pytest.raises(ValueError, match="cannot be truncated"):
            m.truncated(bad)
