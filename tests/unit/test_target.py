import pytest
import torch

from dspark.models.target import LlamaTarget, TargetConfig, TargetRunner
from tests.conftest import TINY, tiny_target


def test_logits_match_transformers_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    hc = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    hf = LlamaForCausalLM(hc).eval()
    ours = LlamaTarget(TargetConfig.from_hf(hc, feature_layers=(0, 1)))
    ours.load_state_dict(hf.state_dict())
    ids = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        ref = hf(input_ids=ids, output_hidden_states=True)
        runner = TargetRunner(ours.eval(), num_slots=2, max_len=32)
        out = runner.step(runner_slots := [runner.allocate(), runner.allocate()], ids.tolist())
    assert (out.logits - ref.logits).abs().max() < 1e-5
    # features = raw outputs of decoder layers 0 and 1 = HF hidden_states[1], [2]
    feats = torch.cat([ref.hidden_states[1], ref.hidden_states[2]], dim=-1)
    assert (out.features - feats).abs().max() < 1e-5
    assert runner_slots == [0, 1]


def test_incremental_ragged_steps_equal_one_full_forward():
    m = tiny_target()
    ids = torch.randint(0, TINY.vocab_size, (3, 15))
    with torch.no_grad():
        full = TargetRunner(m, 3, 32)
        ref = full.step([full.allocate() for _ in range(3)], ids.tolist()).logits
        r = TargetRunner(m, 4, 32)
        slots = [r.allocate() for _ in range(3)]
        cuts = [(0, 4, 9, 15), (0, 1, 2, 15), (0, 7, 8, 15)]
        got = [[] for _ in range(3)]
        for step in range(3):
            toks = [ids[i, cuts[i][step] : cuts[i][step + 1]].tolist() for i in range(3)]
            out = r.step(slots, toks)
            for i in range(3):
                got[i].append(out.logits[i, : len(toks[i])])
    for i in range(3):
        assert torch.allclose(torch.cat(got[i]), ref[i], atol=1e-10)


def test_rollback_discards_rejected_positions():
    m = tiny_target()
    r = TargetRunner(m, 1, 32)
    s = r.allocate()
    r.step([s], [[1, 2, 3]])
    wrong = r.step([s], [[4, 5, 6]]).logits
    r.rollback(s, 3)
    right = r.step([s], [[7, 8]]).logits
    fresh = TargetRunner(m, 1, 32)
    f = fresh.allocate()
    ref = fresh.step([f], [[1, 2, 3, 7, 8]]).logits
    assert torch.allclose(right[0], ref[0, 3:], atol=1e-10)
    assert not torch.allclose(wrong[0, :2], ref[0, 3:], atol=1e-3)


def test_slots_are_released_and_exhaustion_is_a_clear_error():
    r = TargetRunner(tiny_target(), num_slots=2, max_len=8)
    a, b = r.allocate(), r.allocate()
    with pytest.raises(RuntimeError, match="KV slots are in use"):
        r.allocate()
    r.release(a)
    assert r.allocate() == a
    with pytest.raises(ValueError, match="released twice"):
        r.release(b) or r.release(b)


def test_sequence_longer_than_the_cache_is_refused():
    r = TargetRunner(tiny_target(), num_slots=1, max_len=8)
    s = r.allocate()
    with pytest.raises(ValueError, match="exceed the KV cache length"):
        r.step([s], [list(range(9))])


def test_feature_taps_never_include_the_last_layer():
    with pytest.raises(ValueError, match="never the last layer"):
        TargetConfig(
            vocab_size=8,
            hidden_size=8,
            intermediate_size=8,
            num_layers=3,
            num_heads=2,
            num_kv_heads=1,
            head_dim=4,
            feature_layers=(2,),
        )


def test_last_only_step_returns_each_rows_last_logits():
    """A prefill needs only the last position's logits: same values, [R, 1, V]."""
    model = tiny_target()
    full, last = TargetRunner(model, 2, 32), TargetRunner(model, 2, 32)
    toks = [[3, 4, 5, 6, 7], [9, 8]]
    for r in (full, last):
        r.allocate(), r.allocate()
    a = full.step([0, 1], toks)
    b = last.step([0, 1], toks, last_only=True)
    assert b.logits.shape == (2, 1, TINY.vocab_size)
    for r, t in enumerate(toks):
        assert torch.allclose(b.logits[r, 0], a.logits[r, len(t) - 1], atol=1e-10)
    assert torch.equal(a.features, b.features)
