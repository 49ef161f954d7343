"""Imported drafters on the engines (issue 14): `dspark import` then `dspark engines` for the
deepspec-tiny Qwen3 target and its DSpark / DFlash drafters, unchanged build and runtime code;
greedy generation through the ONNX Runtime engines equals the target alone."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark.cli import main
from dspark.core.interfaces import Request
from dspark.core.reference import generate
from dspark.core.scheduler import policy_for
from dspark.core.sps import SPSTable
from dspark.engines.ort import OrtDrafterRunner, OrtTargetRunner, session
from dspark.models.block_drafter import BlockDrafterRunner
from dspark.models.loading import load_target
from dspark.models.target import TargetRunner
from dspark.paths import shared_dir
from dspark.training.pipeline import load_drafter

FIXTURE = shared_dir() / "fixtures" / "deepspec-tiny"
MAX_LEN = 64


def _zlab(dest):
    """The fixture's DFlash weights in z-lab's layout (nested dflash_config, no embedding / head)."""
    dest.mkdir()
    cfg = json.loads((FIXTURE / "dflash" / "config.json").read_text())
    nested = {"mask_token_id": cfg.pop("mask_token_id"), "target_layer_ids": cfg.pop("target_layer_ids")}
    for k in ("markov_rank", "enable_confidence_head", "num_anchors"):
        cfg.pop(k)
    cfg.update(architectures=["DFlashDraftModel"], dflash_config=nested)
    (dest / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(FIXTURE / "dflash" / "model.safetensors"))
    keep = {k: v for k, v in state.items() if k not in ("embed_tokens.weight", "lm_head.weight")}
    save_file(keep, str(dest / "model.safetensors"))
    return dest


@pytest.fixture(scope="module", params=["dspark", "dflash", "z-lab"])
def built(request, tmp_path_factory):
    if not (FIXTURE / "reference.safetensors").exists():
        pytest.skip(f"the deepspec-tiny fixture is not at {FIXTURE} (set DSPARK_SHARED)")
    kind = request.param
    tmp = tmp_path_factory.mktemp(f"import-engines-{kind}")
    target = str(FIXTURE / "target")
    src, source = (_zlab(tmp / "zlab"), "z-lab") if kind == "z-lab" else (FIXTURE / kind, "deepspec")
    rc = main(["import", "--from", source, str(src), "--target", target, "--out", str(tmp / "d")])
    assert rc == 0
    rc = main(
        ["engines", "--target", target, "--drafter", str(tmp / "d"), "--out", str(tmp / "e")]
        + ["--buckets", "1,2", "--max-context", str(MAX_LEN), "--threads", "1"]
        + ["--drafter-precision", "fp32"]  # the imported graphs must accept exactly as PyTorch does
    )
    assert rc == 0
    loaded = load_target(target)
    model, _ = load_drafter(str(tmp / "d"), loaded)
    return kind, loaded, model, tmp / "e"


def _requests():
    ref = load_file(str(FIXTURE / "reference.safetensors"))
    ids = ref["input_ids"].tolist()
    g = torch.Generator().manual_seed(5)
    prompts = [ids[:12], ids[:5], torch.randint(0, 500, (9,), generator=g).tolist()]
    return [Request(p, max_tokens=20) for p in prompts], ref


@pytest.mark.parametrize("mode", ["static:7", "dspark"])
def test_greedy_through_the_engines_with_an_imported_drafter_equals_the_target_alone(built, mode):
    kind, loaded, model, eng = built
    reqs, ref = _requests()
    plain = [r.tokens for r in generate(TargetRunner(loaded.model, 3, MAX_LEN), reqs)]
    assert reqs[0].prompt_ids + plain[0][:16] == ref["target.greedy_output_ids"].tolist()
    sps = SPSTable.from_step_times([1, 64], [1.0, 1.0 + 0.05 * 63])
    ort_t = OrtTargetRunner(session(eng / "target.opt.onnx", 1), loaded.model.cfg, 3, MAX_LEN)
    drafter = OrtDrafterRunner.load(eng, num_slots=3, threads=1)
    res = generate(ort_t, reqs, drafter=drafter, policy=policy_for(mode, sps))
    assert [r.tokens for r in res] == plain
    # the PyTorch runner of the same imported drafter accepts exactly as much
    pm = copy.deepcopy(model).attach(loaded.model.model.embed_tokens.weight, loaded.model.lm_head.weight)
    pt = generate(
        TargetRunner(loaded.model, 3, MAX_LEN),
        reqs,
        BlockDrafterRunner(pm, 3, MAX_LEN),
        policy_for(mode, sps),
    )
    assert [r.tokens for r in pt] == plain
    assert [r.stats.accepted_tokens for r in pt] == [r.stats.accepted_tokens for r in res]
    if mode == "static:7" and kind != "z-lab":  # the fixture's own decode: upstream's acceptances
        want = int(ref[f"{kind}.decode.accepted"].sum())
        first = generate(
            TargetRunner(loaded.model, 1, MAX_LEN),
            [Request(reqs[0].prompt_ids, max_tokens=16 + 9)],
            BlockDrafterRunner(pm, 1, MAX_LEN),
            policy_for("static:7"),
        )[0]
        n, acc = 1, 0
        for t in first.trace:  # rounds while the current token is before position 28
            if 12 + n - 1 >= 28:
                break
            acc += t.accepted
            n += t.accepted + 1
        assert acc == want


def test_engine_build_records_the_imported_drafter_taps(built):
    kind, loaded, model, eng = built
    tmeta = json.loads((eng / "target_meta.json").read_text())
    dmeta = json.loads((eng / "drafter_meta.json").read_text())
    assert tmeta["config"]["feature_layers"] == [1, 3, 5, 7, 9] == dmeta["config"]["feature_layers"]
    assert tmeta["config"]["family"] == "qwen3" and tmeta["config"]["qk_norm"]
    assert dmeta["config"]["qk_norm"] and len(dmeta["draft_vocab"]) == 512
    roles = [e["role"] for e in json.loads((eng / "manifest.json").read_text())["engines"]]
    assert roles.count("drafter_head") == (2 if kind == "dspark" else 0)
