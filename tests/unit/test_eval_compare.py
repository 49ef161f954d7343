"""The paired bootstrap of `dspark.perf.eval_compare` on hand-made eval rounds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dspark.perf.eval_compare import bootstrap_ratios, load_cell, paired_cells, report


def write_rounds(folder: Path, name: str, accepted: list[list[int]]) -> None:
    """One .rounds.npz with the rounds of each prompt in order (accepted drafts per round)."""
    folder.mkdir(parents=True, exist_ok=True)
    acc = np.concatenate([np.array(a) for a in accepted])
    req = np.concatenate([np.full(len(a), i) for i, a in enumerate(accepted)])
    np.savez(
        folder / name,
        accepted=acc,
        verified=np.full(len(acc), 7),
        request=req,
        logits=np.zeros((len(acc), 7)),
    )


def test_cell_sums_per_prompt(tmp_path: Path) -> None:
    write_rounds(tmp_path, "x.rounds.npz", [[0, 2, 1], [6]])
    c = load_cell(tmp_path / "x.rounds.npz")
    assert c.committed.tolist() == [6.0, 7.0] and c.rounds.tolist() == [3.0, 1.0]
    assert c.tau == pytest.approx(13 / 4)  # Σ(accepted + 1) / rounds over all rounds


def test_rounds_without_requests_are_refused(tmp_path: Path) -> None:
    np.savez(tmp_path / "old.rounds.npz", accepted=np.zeros(3), verified=np.full(3, 7))
    with pytest.raises(ValueError, match="request"):
        load_cell(tmp_path / "old.rounds.npz")


def test_identical_drafters_give_one_in_every_draw(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 8, size=rng.integers(3, 9)).tolist() for _ in range(10)]
    for d in ("a", "b"):
        for s in ("gsm8k-test", "humaneval"):
            write_rounds(tmp_path / d, f"dspark-{s}-T0.rounds.npz", prompts)
    cells = paired_cells(tmp_path / "a", tmp_path / "b", "dspark")
    assert set(cells) == {("gsm8k-test", 0), ("humaneval", 0)}
    r = bootstrap_ratios(cells, boot=200)
    assert np.allclose(r["all"], 1.0) and np.allclose(r["T=0"], 1.0)


def test_a_better_drafter_wins_and_the_draws_are_paired(tmp_path: Path) -> None:
    # prompts differ a lot in τ; b accepts one more draft than a in every round: every paired
    # draw must see b ahead, whichever prompts it drew.
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 2 if i % 2 else 6, size=8).tolist() for i in range(12)]
    write_rounds(tmp_path / "a", "dspark-mt-bench-T1.rounds.npz", prompts)
    write_rounds(tmp_path / "b", "dspark-mt-bench-T1.rounds.npz", [[x + 1 for x in p] for p in prompts])
    cells = paired_cells(tmp_path / "a", tmp_path / "b", "dspark")
    a, b = cells[("mt-bench", 1)]
    r = bootstrap_ratios(cells, boot=500)["T=1"]
    assert r[0] == pytest.approx(b.tau / a.tau)  # draw 0 is the data itself
    assert r[1:].min() > 1.0
    brute = (a.committed.sum() + a.rounds.sum()) / a.committed.sum()  # +1 per round, brute force
    assert r[0] == pytest.approx(brute)


def test_evals_of_different_prompt_subsets_are_refused_and_missing_cells_named(tmp_path: Path) -> None:
    # `--limit 12` and `--limit 24` hold different prompts at the same request index
    write_rounds(tmp_path / "a", "dflash-humaneval-T0.rounds.npz", [[1, 1], [3]])
    write_rounds(tmp_path / "b", "dflash-humaneval-T0.rounds.npz", [[1, 1], [3], [6, 6, 6]])
    with pytest.raises(ValueError, match="same `dspark eval --limit`"):
        paired_cells(tmp_path / "a", tmp_path / "b", "dflash")
    write_rounds(tmp_path / "b", "dflash-humaneval-T0.rounds.npz", [[1, 2], [3]])
    text = report(tmp_path / "a", tmp_path / "b", ["dflash", "dspark"], boot=50, seed=0)
    assert "| dflash | humaneval T=0 | 2 |" in text and "| dspark | no cell in both folders" in text
