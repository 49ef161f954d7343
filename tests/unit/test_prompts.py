"""The demo's and tests' prompts ship in the repository; a missing file is an error, never a substitute."""

import pytest

from dspark import prompts


def test_demo_prompts_come_from_the_repository_without_shared(monkeypatch, tmp_path):
    monkeypatch.setenv("DSPARK_SHARED", str(tmp_path / "nothing-here"))
    got = prompts.demo_prompts(per_domain=2)
    assert [d for d, _ in got] == ["math", "math", "code", "code", "chat", "chat"]
    assert len({p for _, p in got}) == 6 and all(len(p) > 40 for _, p in got)
    # the same prompts as the full eval sets' first records, with or without ../shared
    assert prompts.eval_prompts("humaneval", 2) == [p for d, p in got if d == "code"]


def test_eval_prompts_fall_back_to_the_sample_only_when_asked_for_what_it_has(monkeypatch, tmp_path):
    monkeypatch.setenv("DSPARK_SHARED", str(tmp_path))
    assert len(prompts.eval_prompts("mt-bench", 8)) == 8
    with pytest.raises(prompts.PromptsError, match="8 available|available"):
        prompts.eval_prompts("mt-bench", 20)
    with pytest.raises(prompts.PromptsError, match="DSPARK_SHARED"):
        prompts.eval_prompts("gsm8k-test", 1, source="shared")


def test_a_missing_prompt_file_is_an_error_not_a_substitute(monkeypatch, tmp_path):
    monkeypatch.setattr(prompts, "SAMPLE", tmp_path / "missing.jsonl")
    with pytest.raises(prompts.PromptsError, match="missing.jsonl"):
        prompts.demo_prompts()
