"""Target families (issue 14): our Llama / Qwen2 / Qwen3 forward against transformers' own
models on tiny random configs, DeepSpec's tap convention (-1 = embedding output, list order),
refusals, and the deepspec-tiny fixture's Qwen3 target against its reference arrays."""

import json

import pytest
import torch

from dspark.models.loading import hf_config, load_checkpoint_dir, load_target, retap
from dspark.models.target import LlamaTarget, TargetConfig, TargetRunner
from dspark.paths import shared_dir

FIXTURE = shared_dir() / "fixtures" / "deepspec-tiny"
TOL = 1e-4


def _need_fixture():
    if not (FIXTURE / "reference.safetensors").exists():
        pytest.skip(f"the deepspec-tiny fixture is not at {FIXTURE} (set DSPARK_SHARED)")


COMMON = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
)


def _hf(family: str, **kw):
    import transformers as tf

    if family == "llama":
        cfg = tf.LlamaConfig(**COMMON, tie_word_embeddings=True, **kw)
        cls = tf.LlamaForCausalLM
    elif family == "qwen2":
        cfg = tf.Qwen2Config(**COMMON, tie_word_embeddings=False, **kw)
        cls = tf.Qwen2ForCausalLM
    else:
        cfg = tf.Qwen3Config(**COMMON, head_dim=12, tie_word_embeddings=False, **kw)
        cls = tf.Qwen3ForCausalLM
    torch.manual_seed(0)
    hf = cls(cfg).eval()
    with torch.no_grad():  # norms at 1 and biases at 0 would hide a missing term
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape))
    return hf


@pytest.mark.parametrize(
    "family,kw",
    [
        ("llama", {}),
        ("llama", {"attention_bias": True}),
        ("qwen2", {}),
        ("qwen3", {}),
        ("qwen3", {"attention_bias": True}),
    ],
)
def test_each_family_equals_transformers(family, kw):
    hf = _hf(family, **kw)
    taps = (2, -1, 0)  # DeepSpec's convention: -1 = embedding output; concatenated in list order
    cfg = TargetConfig.from_hf(hf.config, feature_layers=taps)
    assert cfg.family == family and cfg.qk_norm == (family == "qwen3")
    ours = LlamaTarget(cfg)
    ours.load_state_dict(hf.state_dict(), strict=not cfg.tie_embeddings)
    ours.eval()
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(input_ids=ids, output_hidden_states=True)
        runner = TargetRunner(ours, num_slots=2, max_len=32)
        slots = [runner.allocate(), runner.allocate()]
        a = runner.step(slots, ids[:, :6].tolist())
        b = runner.step(slots, ids[:, 6:].tolist())  # incremental: the cache path too
    logits = torch.cat([a.logits, b.logits], dim=1)
    feats = torch.cat([a.features, b.features], dim=1)
    assert (logits - ref.logits).abs().max() < TOL
    hs = ref.hidden_states
    assert (feats - torch.cat([hs[3], hs[0], hs[1]], dim=-1)).abs().max() < TOL


def test_llama31_rope_scaling_equals_transformers():
    """Llama-3.1's RoPE (rope_type llama3): every frequency band (kept, interpolated, slowed)."""
    import transformers as tf

    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512,  # with head_dim 8: one wavelength in each band
    }
    torch.manual_seed(0)
    hf = tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON, rope_parameters=rope)).eval()
    cfg = TargetConfig.from_hf(hf.config, feature_layers=(1,))
    assert cfg.rope_scaling == (8.0, 1.0, 4.0, 512.0) and cfg.rope_theta == 500000.0
    assert TargetConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    ours = LlamaTarget(cfg)
    ours.load_state_dict(hf.state_dict())
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        r = TargetRunner(ours.eval(), 1, 64)
        got = r.step([r.allocate()], ids.tolist()).logits
    assert (got - ref).abs().max() < TOL
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
        TargetConfig.from_hf(tf.LlamaConfig(**COMMON, rope_parameters={"rope_type": "yarn", "factor": 2.0}))


def test_unsupported_families_and_settings_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "mistral", "architectures": ["MistralForCausalLM"]})
    )
    with pytest.raises(ValueError, match=r"'mistral'.*supported target families are llama, qwen2, qwen3"):
        hf_config(tmp_path)
    with pytest.raises(ValueError, match="sliding-window"):
        import transformers as tf

        TargetConfig.from_hf(tf.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=8))
    with pytest.raises(ValueError, match="family 'gpt2' is not supported"):
        TargetConfig(8, 8, 8, 2, 2, 1, 4, family="gpt2")
    with pytest.raises(ValueError, match="-1 for the embedding output"):
        TargetConfig(8, 8, 8, 3, 2, 1, 4, feature_layers=(-2,))


def test_wrong_shape_in_a_target_checkpoint_is_named(tmp_path):
    from safetensors.torch import save_file

    hf = _hf("qwen3")
    hf.config.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    state["model.layers.1.self_attn.k_norm.weight"] = torch.ones(5)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"model.layers.1.self_attn.k_norm.weight \(5,\) \(expected \(12,\)\)"
    ):
        load_checkpoint_dir(tmp_path)
    del state["model.layers.1.self_attn.k_norm.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing.*k_norm"):
        load_checkpoint_dir(tmp_path)


@pytest.fixture(scope="module")
def fixture_target():
    _need_fixture()
    from safetensors.torch import load_file

    loaded = load_target(str(FIXTURE / "target"))
    ref = load_file(str(FIXTURE / "reference.safetensors"))
    retap(loaded.model, ref["target_layer_ids"].tolist())
    return loaded, ref


def test_fixture_target_reproduces_the_reference_arrays(fixture_target):
    loaded, ref = fixture_target
    m = loaded.model
    assert loaded.tokenizer is None and m.cfg.family == "qwen3" and m.cfg.qk_norm
    ids = ref["input_ids"]
    runner = TargetRunner(m, 1, 64)
    with torch.no_grad():
        out = runner.step([runner.allocate()], [ids.tolist()])
    assert (out.logits[0] - ref["target.logits"]).abs().max() < TOL
    assert (out.features[0] - ref["target.context_features"]).abs().max() < TOL
    hs = ref["target.hidden_states"]
    assert (out.last_hidden[0] - hs[-1]).abs().max() < TOL  # final normed state
    retap(m, list(range(-1, m.cfg.num_layers - 1)))  # every raw state, embedding included
    try:
        with torch.no_grad():
            r = TargetRunner(m, 1, 64)
            every = r.step([r.allocate()], [ids.tolist()]).features[0]
    finally:
        retap(m, ref["target_layer_ids"].tolist())
    H = m.cfg.hidden_size
    for i in range(m.cfg.num_layers):  # hidden_states[i] = raw output of layer i-1 (0 = embeddings)
        assert (every[:, i * H : (i + 1) * H] - hs[i]).abs().max() < TOL, i


def test_fixture_target_greedy_output(fixture_target):
    from dspark.core.interfaces import Request
    from dspark.core.reference import generate

    loaded, ref = fixture_target
    want = ref["target.greedy_output_ids"].tolist()
    prompt = ref["input_ids"][:12].tolist()
    res = generate(TargetRunner(loaded.model, 1, 64), [Request(prompt, max_tokens=len(want) - 12)])
    assert prompt + res[0].tokens == want


def test_fixture_qwen3_target_engine_passes_the_engine_gates(fixture_target, tmp_path):
    """The Qwen3 step graph through build_target's gates (checker, ORT vs PyTorch, polygraphy),
    then the engine against PyTorch on the fixture's sequence."""
    from dspark.engines.build import BuildConfig, Builder, build_target, sha256_tensors
    from dspark.engines.ort import OrtTargetRunner, session

    loaded, ref = fixture_target
    b = Builder(tmp_path, BuildConfig(buckets=[1], max_context=64, threads=1), log=lambda s: None)
    entry = build_target(b, loaded.model, sha256_tensors(loaded.model))
    assert entry["verified"]["polygraphy"] == "PASSED"
    assert entry["verified"]["max_abs_diff_vs_pytorch"] <= 1e-3
    meta = json.loads((tmp_path / "target_meta.json").read_text())
    assert TargetConfig.from_dict(meta["config"]) == loaded.model.cfg
    ort_t = OrtTargetRunner(session(tmp_path / "target.opt.onnx", 1), loaded.model.cfg, 1, 64)
    out = ort_t.step([ort_t.allocate()], [ref["input_ids"].tolist()])
    assert (out.logits[0] - ref["target.logits"]).abs().max() < TOL
    assert (out.features[0] - ref["target.context_features"]).abs().max() < TOL


def test_two_first_uses_converting_at_once_both_end_with_one_checkpoint(tmp_path):
    """Two processes converting the default target at once (make data and make engines started
    together) each write their own temporary folder; the second to finish keeps the first's copy."""
    from dspark.models.loading import _publish

    dest = tmp_path / "smollm2"
    for pid in (1, 2):
        tmp = tmp_path / f"smollm2.tmp{pid}"
        tmp.mkdir()
        (tmp / "model.safetensors").write_bytes(b"same bytes")
        _publish(tmp, dest)
        assert not tmp.exists()
    assert (dest / "model.safetensors").read_bytes() == b"same bytes"
    broken = tmp_path / "smollm2.tmp3"
    broken.mkdir()
    (broken / "x").write_text("x")
    with pytest.raises(OSError):
        _publish(broken, tmp_path / "not-a-folder-yet" / "deeper")
