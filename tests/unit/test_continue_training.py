"""Issue 12: training continues from a shipped (fp16) drafter — its weights, its vocabulary, its lineage."""

import json

import pytest
import torch

from dspark.training.pipeline import load_drafter, run_training
from dspark.training.train import TrainConfig
from tests.unit.test_block_drafter import _tiny_cache


def _run(loaded, tmp_path, out, steps, until=None, init_from=None, kind="dspark"):
    tc = TrainConfig(steps=steps, seqs_per_step=2, anchors_per_seq=8, lr=1e-3, log_every=2, ckpt_every=2)
    return run_training(
        loaded,
        kind,
        tmp_path / "a.jsonl",
        tmp_path / "cache",
        tmp_path / out,
        tc,
        vocab_size=64,
        num_layers=1,
        until=until,
        init_from=init_from,
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


def test_continuing_a_drafter_of_another_kind_is_refused(tmp_path):
    loaded, _ = _tiny_cache(tmp_path, n=8, max_new=16)
    first = _run(loaded, tmp_path, "run1", steps=2)
    first["model"].save(tmp_path / "ship1", extra={"summary": {"steps": 2}})
    with pytest.raises(ValueError, match="is a dspark drafter, not dflash"):
        _run(loaded, tmp_path, "run2", steps=2, init_from=tmp_path / "ship1", kind="dflash")
