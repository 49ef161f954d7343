"""Training-data regeneration: resumable, and the on-the-fly target cache equals a full forward."""

import json
from pathlib import Path

import numpy as np
import torch

from dspark.models.loading import LoadedTarget
from dspark.models.target import TargetRunner
from dspark.training.data import Prompt, read_answers, regenerate
from tests.conftest import TINY, tiny_target


class CharTokenizer:
    """Maps characters to ids 1..60; id 0 is the end of turn (the tiny target's stop id)."""

    def apply_chat_template(self, msgs, tokenize=False, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}" for m in msgs) + (
            "<a>" if add_generation_prompt else ""
        )

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1 + (ord(c) % (TINY.vocab_size - 1)) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _loaded():
    return LoadedTarget(tiny_target(seed=5), CharTokenizer(), "tiny")


PROMPTS = [Prompt("pool", i, f"question number {i}?" * (1 + i % 3)) for i in range(7)]


def test_regeneration_is_resumable_and_deterministic(tmp_path):
    loaded = _loaded()
    out = tmp_path / "answers.jsonl"
    regenerate(loaded, PROMPTS, out, batch=3, max_new_tokens=12, limit=4)
    assert len(list(read_answers(out))) == 4
    regenerate(loaded, PROMPTS, out, batch=3, max_new_tokens=12)
    first = {a["key"]: a["answer_ids"] for a in read_answers(out)}
    assert sorted(first) == sorted(p.key for p in PROMPTS)
    again = tmp_path / "again.jsonl"
    regenerate(loaded, PROMPTS, again, batch=2, max_new_tokens=12)  # other batch size, same answers
    assert {a["key"]: a["answer_ids"] for a in read_answers(again)} == first


def test_a_line_cut_by_an_interrupted_run_is_skipped(tmp_path):
    out = tmp_path / "answers.jsonl"
    out.write_text(json.dumps({"key": "pool/0"}) + "\n" + '{"key": "pool/1", "ans')
    assert [a["key"] for a in read_answers(out)] == ["pool/0"]


def test_captured_target_cache_equals_a_full_forward(tmp_path):
    loaded = _loaded()
    regenerate(
        loaded, PROMPTS[:3], tmp_path / "a.jsonl", cache_dir=tmp_path / "cache", batch=2, max_new_tokens=10
    )
    runner = TargetRunner(loaded.model, 1, 256)
    for rec in read_answers(tmp_path / "a.jsonl"):
        z = np.load(tmp_path / "cache" / f"pool-{rec['index']}.npz")
        tokens = rec["prompt_ids"] + rec["answer_ids"]
        assert z["tokens"].tolist() == tokens and int(z["prompt_len"]) == len(rec["prompt_ids"])
        slot = runner.allocate()
        with torch.no_grad():
            step = runner.step([slot], [tokens[:-1]])  # the last token is never fed
        runner.release(slot)
        assert z["features"].shape == (len(tokens) - 1, TINY.feature_size)
        assert np.allclose(z["features"], step.features[0].numpy(), atol=2e-3 * np.abs(z["features"]).max())
        assert np.allclose(z["last_hidden"], step.last_hidden[0].numpy(), atol=1e-2)
        assert np.allclose(z["lse"], torch.logsumexp(step.logits[0], -1).numpy(), atol=1e-6)


def test_cache_rebuilt_from_answers_equals_the_cache_captured_during_generation(tmp_path):
    from dspark.training.data import build_cache

    loaded = _loaded()
    regenerate(
        loaded, PROMPTS[:3], tmp_path / "a.jsonl", cache_dir=tmp_path / "live", batch=2, max_new_tokens=10
    )
    assert build_cache(loaded, tmp_path / "a.jsonl", tmp_path / "rebuilt") == 3
    for f in sorted((tmp_path / "live").glob("*.npz")):
        a, b = np.load(f), np.load(tmp_path / "rebuilt" / f.name)
        assert a["tokens"].tolist() == b["tokens"].tolist()
        assert np.allclose(a["features"], b["features"], atol=2e-3 * np.abs(a["features"]).max())
        assert np.allclose(a["lse"], b["lse"], atol=1e-6)
    assert build_cache(loaded, tmp_path / "a.jsonl", tmp_path / "rebuilt") == 0  # nothing left to do


def test_cache_builders_on_one_folder_skip_what_the_other_wrote(tmp_path, monkeypatch):
    """Two builders may share a cache folder (one from each end of the answers): a sample another
    builder wrote after this one listed its work is skipped, not computed again."""
    from dspark.training import data as D

    loaded = _loaded()
    regenerate(loaded, PROMPTS[:3], tmp_path / "a.jsonl", cache_dir=None, batch=2, max_new_tokens=6)
    answers = list(D.read_answers(tmp_path / "a.jsonl"))
    last = tmp_path / "c" / f"{answers[-1]['pool']}-{answers[-1]['index']}.npz"
    write = D._write_npz

    def write_and_let_the_other_builder_write_the_last(path, *a):
        write(path, *a)
        if not last.exists():
            write(last, *a)  # the other builder, walking from the end

    monkeypatch.setattr(D, "_write_npz", write_and_let_the_other_builder_write_the_last)
    assert D.build_cache(loaded, tmp_path / "a.jsonl", tmp_path / "c") == 2
    assert len(list((tmp_path / "c").glob("*.npz"))) == 3
    order = []
    monkeypatch.setattr(D, "_write_npz", lambda path, *a: order.append(Path(path).stem) or write(path, *a))
    assert D.build_cache(loaded, tmp_path / "a.jsonl", tmp_path / "r", reverse=True) == 3
    assert order == [f"{a['pool']}-{a['index']}" for a in reversed(answers)]  # from the end


def test_cache_rebuild_in_a_seeded_random_order(tmp_path, monkeypatch):
    """--shuffle SEED: a cache stopped part-way is a uniform sample of the answers, and the same
    seed walks the same order (reverse and shuffle are refused together)."""
    import pytest

    from dspark.training import data as D

    loaded = _loaded()
    regenerate(loaded, PROMPTS, tmp_path / "a.jsonl", cache_dir=None, batch=3, max_new_tokens=4)
    keys = [f"{a['pool']}-{a['index']}" for a in D.read_answers(tmp_path / "a.jsonl")]
    write, orders = D._write_npz, []
    record = lambda path, *a: orders[-1].append(Path(path).stem) or write(path, *a)  # noqa: E731
    monkeypatch.setattr(D, "_write_npz", record)
    for folder, seed in (("s1", 1), ("s1b", 1), ("s2", 2)):
        orders.append([])
        assert D.build_cache(loaded, tmp_path / "a.jsonl", tmp_path / folder, shuffle=seed) == len(keys)
    assert sorted(orders[0]) == sorted(keys) and orders[0] == orders[1]
    assert orders[0] != keys and orders[2] != orders[0]  # fixed seeds: deterministic
    with pytest.raises(ValueError, match="pick one"):
        D.build_cache(loaded, tmp_path / "a.jsonl", tmp_path / "x", reverse=True, shuffle=1)


def test_snapshot_keeps_the_complete_answers_of_a_running_job(tmp_path):
    from dspark.training.data import write_snapshot

    answers = tmp_path / "answers.jsonl"
    done = [{"pool": "gsm8k-train", "index": i, "answer_ids": [i, 2], "answer": f"{i}"} for i in range(3)]
    done.append({"pool": "codealpaca", "index": 0, "answer_ids": [5, 2]})
    text = "".join(json.dumps(a) + "\n" for a in done)
    answers.write_text(text + '{"pool": "codealpaca", "index": 1, "answer_')  # the job is mid-line
    dest = tmp_path / "snap" / "answers.jsonl.gz"
    assert write_snapshot(answers, dest) == {"gsm8k-train": 3, "codealpaca": 1}
    # every field but the decoded text, which answer_ids hold
    assert list(read_answers(dest)) == [{k: v for k, v in a.items() if k != "answer"} for a in done]
    assert not list(dest.parent.glob("*.tmp"))


def test_extra_answers_have_their_own_keys_seeds_cache_and_sampling(tmp_path):
    """`dspark data --extra-samples`: a prompt's k-th extra answer is keyed pool/index~k, drawn
    with its own seed at the given sampling, cached beside the first answer (never over it),
    resumable like the first pass, and its cache equals a rebuild from the answers."""
    from dspark.core.sampling import SamplingParams
    from dspark.training.data import build_cache, cache_file, extra_samples

    loaded = _loaded()
    out, live = tmp_path / "a.jsonl", tmp_path / "live"
    regenerate(loaded, PROMPTS[:3], out, cache_dir=live, batch=2, max_new_tokens=10)
    extra = extra_samples(PROMPTS[:3], 2)
    assert [p.key for p in extra[:4]] == ["pool/0~1", "pool/1~1", "pool/2~1", "pool/0~2"]
    t1 = SamplingParams(temperature=1.0)
    regenerate(loaded, extra, out, cache_dir=live, batch=2, max_new_tokens=10, params=t1, limit=5)
    regenerate(loaded, extra, out, cache_dir=live, batch=2, max_new_tokens=10, params=t1)  # resumes
    recs = {a["key"]: a for a in read_answers(out)}
    assert len(recs) == 9 and len(list(live.glob("*.npz"))) == 9
    first, second = recs["pool/1"], recs["pool/1~1"]
    assert "sample" not in first and (second["sample"], second["temperature"], second["top_p"]) == (
        1,
        1.0,
        1.0,
    )
    assert first["prompt_ids"] == second["prompt_ids"]
    assert len({tuple(recs[f"pool/1{k}"]["answer_ids"]) for k in ("", "~1", "~2")}) > 1  # other seeds
    assert cache_file(live, second).name == "pool-1~1.npz" and cache_file(live, first).name == "pool-1.npz"
    assert build_cache(loaded, out, tmp_path / "rebuilt") == 9
    for a in recs.values():
        z, r = np.load(cache_file(live, a)), np.load(cache_file(tmp_path / "rebuilt", a))
        assert z["tokens"].tolist() == r["tokens"].tolist() == a["prompt_ids"] + a["answer_ids"]


def test_a_prompts_extra_answers_are_held_out_with_it():
    """The held-out split goes by prompt: pool/index~k lands where pool/index does; a held-out
    prompt keeps one record (its STS rollouts), its extras are neither trained on nor repeated."""
    from dspark.training.pipeline import is_holdout, split_cache

    keys = [f"pool/{i}" for i in range(400)]
    held = [k for k in keys if is_holdout(k)]
    assert 0 < len(held) < 100
    assert all(is_holdout(f"{k}~{s}") == is_holdout(k) for k in keys for s in (1, 7))
    recs = [{"key": k, "pool": "pool", "index": i, "answer_ids": [i]} for i, k in enumerate(keys)]
    recs += [dict(r, key=r["key"] + "~1", sample=1) for r in recs]
    files, held_recs, tokens = split_cache(recs, None)
    assert [r["key"] for r in held_recs] == held
    assert len(tokens) == 2 * (len(keys) - len(held)) and files == []


def test_data_names_a_bad_pool_or_extra_setting_before_loading_anything(tmp_path, capsys):
    from dspark.cli import main

    out = str(tmp_path / "a.jsonl")
    assert main(["data", "--pools", "arena-hard-v2,no-such-pool", "--out", out]) == 2
    assert "no-such-pool" in capsys.readouterr().err
    assert main(["data", "--pools", "arena-hard-v2", "--extra-samples", "-1", "--out", out]) == 2
    assert main(["data", "--pools", "all", "--extra-temperature", "0", "--out", out]) == 2
    assert "--extra-temperature" in capsys.readouterr().err
    assert main(["data", "--new-only", "--no-generate", "--out", out]) == 2
    assert "--new-only" in capsys.readouterr().err
    assert not (tmp_path / "a.jsonl").exists()
