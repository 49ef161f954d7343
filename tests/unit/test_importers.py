"""`dspark import` (issue 14): the deepspec-tiny fixture's drafters reproduce every reference
array through our checkpoint format; corrupted checkpoints get precise errors; the importer
and the verifier work on a differently sized DeepSpec-format fixture (checked by an independent
plain-torch implementation of the fixture README's §4 formulas), on z-lab's nested DFlash
config and on the vLLM / SGLang EAGLE-3 layout."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark.cli import main
from dspark.models.import_verify import Drafter, verify
from dspark.models.importers import CheckpointError, convert, import_drafter, inspect, target_head_tensors
from dspark.models.loading import load_target
from dspark.paths import shared_dir
from dspark.training.pipeline import load_drafter

FIXTURE = shared_dir() / "fixtures" / "deepspec-tiny"
REF = FIXTURE / "reference.safetensors"


@pytest.fixture(scope="module")
def fixture():
    if not REF.exists():
        pytest.skip(f"the deepspec-tiny fixture is not at {FIXTURE} (set DSPARK_SHARED)")
    return FIXTURE


# -- the fixture, end to end through the command ------------------------------------------------


def test_import_verify_reproduces_every_reference_array(fixture, tmp_path, capsys):
    rc = main(
        ["import", "--from", "deepspec", str(fixture), "--target", str(fixture / "target")]
        + ["--out", str(tmp_path), "--verify", str(REF)]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    ref = load_file(str(REF))
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.split() and ln.split()[0] in ref}
    assert set(lines) == set(ref)  # one line per array, none forgotten
    inputs = {"input_ids", "anchors", "target_layer_ids", "dspark.train_loss_mask", "dflash.train_loss_mask"}
    for name, line in lines.items():
        assert line.rstrip().endswith("input" if name in inputs else "ok"), line
    assert "0 beyond tolerance" in out
    for kind in ("dspark", "dflash", "eagle3"):  # our checkpoint format, upstream dtype kept
        meta = json.loads((tmp_path / kind / "drafter.json").read_text())
        assert meta["imported"]["source"] == "deepspec" and meta["imported"]["dtype"] == "float32"
        assert load_file(str(tmp_path / kind / "drafter.safetensors"))["norm.weight"].dtype == torch.float32


def test_verify_exits_non_zero_beyond_tolerance(fixture, tmp_path, capsys):
    rc = main(
        ["import", str(fixture / "dflash"), "--target", str(fixture / "target"), "--out", str(tmp_path)]
        + ["--verify", str(REF), "--atol", "1e-9"]
    )
    captured = capsys.readouterr()
    assert rc == 1
    assert "FAIL" in captured.out and "beyond tolerance" in captured.err
    assert "no dspark drafter given" in captured.out  # other kinds in the file: listed, skipped


def test_check_prints_what_it_found_and_writes_nothing(fixture, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc = main(["import", "--check", str(fixture / "dspark"), "--target", str(fixture / "target")])
    out = capsys.readouterr().out
    assert rc == 0
    for want in (
        "Qwen3DSparkModel",
        "layer ids [1, 3, 5, 7, 9]",
        "HF hidden_states [2, 4, 6, 8, 10]",
        "all 512",
        "mask token id 500",
        "Markov vanilla rank 16",
        "confidence head on [h; W1[prev]]",
        "qwen3, 12 layers",
    ):
        assert want in out, want
    assert not any(tmp_path.iterdir())
    assert main(["import", "--from", "vllm", str(fixture / "dspark"), "--check"]) == 2
    assert "not --from vllm" in capsys.readouterr().err
    assert main(["import", "--check", str(fixture / "dspark"), "--layer-ids=-1,2,4,6,8"]) == 0
    assert "layer ids [-1, 2, 4, 6, 8]" in capsys.readouterr().out  # the override wins
    assert main(["import", "--check", str(fixture / "dspark"), "--layer-ids", "1,3"]) == 2
    assert "but 2 target layers" in capsys.readouterr().err
    assert main(["import", "--check", str(fixture / "dflash"), "--mask-token-id", "511"]) == 0
    assert "mask token id 511" in capsys.readouterr().out


# -- corrupted checkpoints ----------------------------------------------------------------------


def _corrupt(fixture, tmp_path, kind="dspark", config=None, tensors=None):
    d = tmp_path / f"bad-{kind}"
    shutil.copytree(fixture / kind, d)
    if config:
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(config)
        (d / "config.json").write_text(json.dumps(cfg))
    if tensors:
        state = load_file(str(d / "model.safetensors"))
        tensors(state)
        save_file(state, str(d / "model.safetensors"))
    return d


def _convert(d, fixture):
    cfg, embed, head = target_head_tensors(fixture / "target")
    return convert(inspect(d), embed, head, cfg)


@pytest.mark.parametrize(
    "change,match",
    [
        (
            dict(tensors=lambda s: s.pop("layers.1.self_attn.k_norm.weight")),
            r"missing tensor layers\.1\.self_attn\.k_norm\.weight \(expected shape \[16\]\)",
        ),
        (
            dict(tensors=lambda s: s.update({"fc.weight": torch.zeros(64, 256)})),
            r"fc\.weight has shape \(64, 256\), but 5 target layers",
        ),
        (
            dict(tensors=lambda s: s.update({"markov_head.markov_w2.weight": torch.zeros(512, 8)})),
            r"tensor markov_head\.markov_w2\.weight has shape \[512, 8\], expected \[512, 16\]",
        ),
        (
            dict(tensors=lambda s: s.update({"markov_head.gate.weight": torch.zeros(16, 16)})),
            r"unexpected tensor\(s\) \['markov_head\.gate\.weight'\]",
        ),
        (
            dict(config={"markov_head_type": "gated"}),
            r"markov_head_type 'gated' is not supported yet: supported Markov heads are \['vanilla'\]",
        ),
        (dict(config={"markov_head_type": "lstm"}), r"markov_head_type 'lstm' is unknown"),
        (
            dict(config={"architectures": ["MysteryDraftModel"], "markov_rank": None}),
            r"'MysteryDraftModel' is not a drafter this importer knows: supported are Qwen3DSparkModel",
        ),
        (dict(config={"mask_token_id": 600}), r"mask_token_id 600 is outside the vocabulary of 512"),
        (
            dict(config={"target_layer_ids": [1, 3, 5, 7, 11]}),
            r"target_layer_ids \[1, 3, 5, 7, 11\] out of range",
        ),
        (
            dict(config={"num_hidden_layers": 3}),
            r"config\.json says 3 draft layer\(s\) but the weights hold layers \[0, 1\]",
        ),
        (
            dict(tensors=lambda s: s["embed_tokens.weight"].mul_(2.0)),
            r"embed_tokens\.weight differs from the target's",
        ),
    ],
)
def test_corrupted_checkpoints_get_precise_errors(fixture, tmp_path, change, match):
    d = _corrupt(fixture, tmp_path, **change)
    with pytest.raises(CheckpointError, match=match):
        _convert(d, fixture)


def test_confidence_without_markov_features_and_refusals(fixture, tmp_path):
    d = _corrupt(
        fixture,
        tmp_path,
        config={"confidence_head_with_markov": False},
        tensors=lambda s: s.update(
            {"confidence_head.proj.weight": s["confidence_head.proj.weight"][:, :64].clone()}
        ),
    )
    m = _convert(d, fixture)
    assert m.cfg.confidence and not m.cfg.confidence_with_markov and m.conf.weight.shape == (1, 64)
    h = torch.randn(3, 64)
    _, c, _ = m.head_step(torch.zeros(3, 512), h, torch.tensor([1, 2, 3]), None)
    assert torch.allclose(c, m.conf(h).squeeze(-1))
    d2 = _corrupt(fixture, tmp_path, kind="dflash", config={"enable_confidence_head": True})
    with pytest.raises(CheckpointError, match="confidence head on a drafter without a Markov head"):
        inspect(d2)


def test_a_target_that_does_not_fit_is_refused(fixture, tmp_path):
    d = _corrupt(fixture, tmp_path, config={"num_target_layers": 36})
    with pytest.raises(CheckpointError, match=r"target has 12 layers \(drafter trained on 36\)"):
        _convert(d, fixture)


# -- other fixtures made the same way ------------------------------------------------------------


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    """x [n, heads, D] at positions pos [n]: HF rotate-half RoPE."""
    D = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = pos.double()[:, None] * inv
    cos, sin = (
        torch.cat([ang, ang], -1).cos().float()[:, None],
        torch.cat([ang, ang], -1).sin().float()[:, None],
    )
    rot = torch.cat([-x[..., D // 2 :], x[..., : D // 2]], -1)
    return x * cos + rot * sin


def _plain_block(W, cfg, feat, anchor_tok, a, mask_id):
    """README §4.1 written out independently: context projection, non-causal block over
    [ctx; block] keys, Qwen3 q/k norms, final norm and LM head."""
    eps, nh, nkv = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, G, theta = cfg["head_dim"], cfg["block_size"], cfg["rope_parameters"]["rope_theta"]
    ctx = _rms(feat[:a] @ W["fc.weight"].T, W["hidden_norm.weight"], eps)
    x = W["embed_tokens.weight"][torch.tensor([anchor_tok] + [mask_id] * (G - 1))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        h = _rms(x, W[p + "input_layernorm.weight"], eps)
        q = _rms(
            (h @ W[p + "self_attn.q_proj.weight"].T).view(G, nh, hd), W[p + "self_attn.q_norm.weight"], eps
        )
        kin = torch.cat([ctx, h])
        k = _rms(
            (kin @ W[p + "self_attn.k_proj.weight"].T).view(a + G, nkv, hd),
            W[p + "self_attn.k_norm.weight"],
            eps,
        )
        v = (kin @ W[p + "self_attn.v_proj.weight"].T).view(a + G, nkv, hd)
        q, k = _rope(q, torch.arange(a, a + G), theta), _rope(k, torch.arange(a + G), theta)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        att = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        )
        x = x + att.transpose(0, 1).reshape(G, nh * hd) @ W[p + "self_attn.o_proj.weight"].T
        u = _rms(x, W[p + "post_attention_layernorm.weight"], eps)
        mlp = torch.nn.functional.silu(u @ W[p + "mlp.gate_proj.weight"].T) * (
            u @ W[p + "mlp.up_proj.weight"].T
        )
        x = x + mlp @ W[p + "mlp.down_proj.weight"].T
    hidden = _rms(x, W["norm.weight"], eps)
    return hidden, hidden @ W["lm_head.weight"].T


def _make_family(tmp_path, layer_ids, rank, block, with_markov, seed):
    """A random HF Qwen3 target and a DeepSpec-format DSpark drafter of other sizes, plus a
    reference file computed by HF (target) and the plain implementation above (drafter)."""
    import transformers as tf

    torch.manual_seed(seed)
    V, H, L = 300, 48, 7
    tc = tf.Qwen3Config(
        vocab_size=V, hidden_size=H, intermediate_size=80, num_hidden_layers=L, num_attention_heads=6,
        num_key_value_heads=3, head_dim=8, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )  # fmt: skip
    hf = tf.Qwen3ForCausalLM(tc).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            p.copy_(
                1 + 0.1 * torch.randn(p.shape)
                if n.endswith("norm.weight")
                else torch.randn(p.shape) / p.shape[-1] ** 0.5
            )
    tdir, ddir = tmp_path / "target", tmp_path / "drafter"
    hf.save_pretrained(tdir)
    mask = V - 7
    dcfg = dict(json.loads((tdir / "config.json").read_text()))
    dcfg.update(
        architectures=["Qwen3DSparkModel"], num_hidden_layers=3, layer_types=["full_attention"] * 3,
        num_target_layers=L, target_layer_ids=layer_ids, block_size=block, mask_token_id=mask, num_anchors=64,
        markov_rank=rank, markov_head_type="vanilla", enable_confidence_head=True,
        confidence_head_with_markov=with_markov,
    )  # fmt: skip
    T = {
        "embed_tokens.weight": hf.model.embed_tokens.weight.detach().clone(),
        "lm_head.weight": hf.lm_head.weight.detach().clone(),
    }
    F, I, nh, nkv, hd = len(layer_ids) * H, 80, 6, 3, 8
    shapes = {"fc.weight": (H, F), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(3):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (nh * hd, H), p + "self_attn.k_proj.weight": (nkv * hd, H),
            p + "self_attn.v_proj.weight": (nkv * hd, H), p + "self_attn.o_proj.weight": (H, nh * hd),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
            p + "mlp.down_proj.weight": (H, I),
        })  # fmt: skip
    shapes.update({"markov_head.markov_w1.weight": (V, rank), "markov_head.markov_w2.weight": (V, rank)})
    shapes.update(
        {
            "confidence_head.proj.weight": (1, H + (rank if with_markov else 0)),
            "confidence_head.proj.bias": (1,),
        }
    )
    for k, s in shapes.items():
        T[k] = (
            1 + 0.1 * torch.randn(s)
            if k.endswith("norm.weight")
            else torch.randn(s) / (s[-1] ** 0.5 if len(s) > 1 else 3)
        )
    ddir.mkdir()
    (ddir / "config.json").write_text(json.dumps(dcfg))
    save_file({k: v.contiguous() for k, v in T.items()}, str(ddir / "model.safetensors"))

    ids = torch.randint(0, V - 10, (20,))
    anchors = [6, 11]
    with torch.no_grad():
        out = hf(input_ids=ids[None], output_hidden_states=True)
    hs = out.hidden_states
    feat = torch.cat([hs[i + 1][0] for i in layer_ids], -1)
    ref = {
        "input_ids": ids,
        "anchors": torch.tensor(anchors),
        "target.logits": out.logits[0],
        "target.context_features": feat,
    }
    ref["dspark.context_projected"] = _rms(feat @ T["fc.weight"].T, T["hidden_norm.weight"], 1e-6)
    dcfg["head_dim"] = hd
    blocks = [_plain_block(T, dcfg, feat, int(ids[a]), a, mask) for a in anchors]
    ref["dspark.block_hidden"] = torch.stack([b[0] for b in blocks])
    ref["dspark.base_logits"] = torch.stack([b[1] for b in blocks])
    greedy, zs, cs = [], [], []
    for (hidden, base), a in zip(blocks, anchors):  # §4.2–4.3: sequential greedy Markov + confidence
        prev, toks, z_rows, c_rows = int(ids[a]), [], [], []
        for k in range(block):
            e = T["markov_head.markov_w1.weight"][prev]
            z = base[k] + T["markov_head.markov_w2.weight"] @ e
            cin = torch.cat([hidden[k], e]) if with_markov else hidden[k]
            c_rows.append(cin @ T["confidence_head.proj.weight"][0] + T["confidence_head.proj.bias"][0])
            prev = int(z.argmax())
            toks.append(prev)
            z_rows.append(z)
        greedy.append(toks), zs.append(torch.stack(z_rows)), cs.append(torch.stack(c_rows))
    ref["dspark.greedy_tokens"] = torch.tensor(greedy)
    ref["dspark.greedy_logits"] = torch.stack(zs)
    ref["dspark.greedy_confidence_logits"] = torch.stack(cs)
    meta = {"target_layer_ids": json.dumps(layer_ids), "anchors": json.dumps(anchors)}
    save_file(
        {k: v.detach().contiguous() for k, v in ref.items()}, str(tmp_path / "reference.safetensors"), meta
    )
    return tdir, ddir, tmp_path / "reference.safetensors"


@pytest.mark.parametrize(
    "layer_ids,rank,block,with_markov,seed", [([-1, 2, 4], 8, 5, True, 3), ([0, 1, 3, 5], 4, 3, False, 4)]
)
def test_other_sizes_layer_ids_and_ranks_verify_against_an_independent_implementation(
    tmp_path, capsys, layer_ids, rank, block, with_markov, seed
):
    tdir, ddir, ref = _make_family(tmp_path, layer_ids, rank, block, with_markov, seed)
    rc = main(
        [
            "import",
            "--from",
            "deepspec",
            str(ddir),
            "--target",
            str(tdir),
            "--out",
            str(tmp_path / "out"),
            "--verify",
            str(ref),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"{len(load_file(str(ref))) - 2} arrays recomputed" in out  # all but the 2 inputs


def test_z_lab_dflash_layout_nested_config_own_position_slots(fixture, tmp_path):
    """z-lab's DFlash: dflash_config holds mask token and layer ids, the file holds no embedding
    or LM head (the target's are used), and a block of block_size inputs [anchor, MASK…] drafts
    from its MASK slots, each predicting its own position (block_size − 1 drafts). Checked
    against the independent implementation of the block above; then lossless end to end."""
    d = tmp_path / "zlab"
    d.mkdir()
    cfg = json.loads((fixture / "dflash" / "config.json").read_text())
    nested = {"mask_token_id": cfg.pop("mask_token_id"), "target_layer_ids": cfg.pop("target_layer_ids")}
    for k in ("markov_rank", "enable_confidence_head", "num_anchors"):
        cfg.pop(k)
    cfg.update(architectures=["DFlashDraftModel"], dflash_config=nested)
    (d / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(fixture / "dflash" / "model.safetensors"))
    save_file(
        {k: v for k, v in state.items() if k not in ("embed_tokens.weight", "lm_head.weight")},
        str(d / "model.safetensors"),
    )
    up = inspect(d)
    assert (up.source, up.kind, up.mask_token_id, up.layer_ids) == ("z-lab", "dflash", 500, (1, 3, 5, 7, 9))
    assert up.block_size == 6  # block_size 7 = the anchor + 6 drafting MASK slots
    import_drafter(d, fixture / "target", tmp_path / "out")
    loaded = load_target(str(fixture / "target"))
    model, _ = load_drafter(str(tmp_path / "out"), loaded)
    assert model.cfg.predict_own_position and model.cfg.block_size == 6
    ref = load_file(str(REF))
    ids, feat = ref["input_ids"].tolist(), ref["target.context_features"]
    W = dict(state)
    W.update(
        {
            "embed_tokens.weight": loaded.model.model.embed_tokens.weight,
            "lm_head.weight": loaded.model.lm_head.weight,
        }
    )
    for a in ref["anchors"].tolist():
        _, plain = _plain_block(W, {**cfg, "block_size": 7}, feat, ids[a], a, 500)
        ctx = model.context_kv(model.project_context(feat[:a].unsqueeze(0)), torch.arange(a).unsqueeze(0))
        with torch.no_grad():
            U, _ = model.backbone(
                torch.tensor([ids[a]]), torch.tensor([a]), ctx, torch.ones(1, a, dtype=torch.bool)
            )
        assert (U[0] - plain[1:]).abs().max() < 1e-4  # slot k + 1 (position a + k + 1) → draft k
    from dspark.core.interfaces import Request
    from dspark.core.reference import generate
    from dspark.core.scheduler import policy_for
    from dspark.models.runners import runner_for
    from dspark.models.target import TargetRunner

    req = [Request(ids[:12], max_tokens=16)]
    spec = generate(TargetRunner(loaded.model, 1, 64), req, runner_for(model, 1, 64), policy_for("static:6"))
    assert ids[:12] + spec[0].tokens == ref["target.greedy_output_ids"].tolist()
    bare = dict(cfg, dflash_config={"mask_token_id": 500})  # no layer ids: z-lab's default rule
    (d / "config.json").write_text(json.dumps(bare))
    with pytest.raises(CheckpointError, match=r"fc\.weight has shape \(64, 320\), but 2 target layers"):
        inspect(d)  # two draft layers → taps [1, 9] by the rule, which this fc does not read


def test_vllm_eagle3_layout_with_d2t_and_its_own_lm_head(fixture, tmp_path):
    """The vLLM / SGLang layout (midlayer.*, d2t, own LM head): the fixture's EAGLE-3 rewritten
    in it gives the same arrays; a draft vocabulary subset maps through d2t."""
    d = tmp_path / "vllm"
    d.mkdir()
    cfg = json.loads((fixture / "eagle3" / "config.json").read_text())
    cfg.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=512)
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": cfg.pop("target_layer_ids")}
    (d / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(fixture / "eagle3" / "model.safetensors"))
    new = {k.replace("layers.0.", "midlayer."): v for k, v in state.items() if k != "embed_tokens.weight"}
    new["d2t"] = torch.zeros(512, dtype=torch.long)
    save_file(new, str(d / "model.safetensors"))
    up = inspect(d)
    assert (up.source, up.kind, up.layer_ids) == ("vllm", "eagle3", (1, 3, 5, 7, 9))
    import_drafter(d, fixture / "target", tmp_path / "out")
    loaded = load_target(str(fixture / "target"))
    model, _ = load_drafter(str(tmp_path / "out"), loaded)
    assert model.cfg.own_lm_head and model.cfg.layout == "upstream"
    rows = verify(REF, loaded.model, {"eagle3": Drafter(model)}, log=None)
    checked = [r for r in rows if r.name.startswith("eagle3.")]
    assert len(checked) == 13 and all(r.status == "ok" for r in checked), [
        r.line() for r in checked if r.failed
    ]
    # a draft vocabulary of 100 ids, mapped to target ids 2·i by d2t = i
    sub = {k: v for k, v in new.items()}
    sub["lm_head.weight"] = new["lm_head.weight"][::2][:100].clone()
    sub["d2t"] = torch.arange(100)
    cfg["draft_vocab_size"] = 100
    (d / "config.json").write_text(json.dumps(cfg))
    save_file(sub, str(d / "model.safetensors"))
    m = _convert(d, fixture)
    assert torch.equal(m.draft_vocab, torch.arange(0, 200, 2))
    assert torch.equal(m.lm_head, sub["lm_head.weight"])
