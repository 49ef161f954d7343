"""dspark.perf.sts_refit: fit STS on recorded rollouts, score it on eval rounds, write it into a
drafter (issue 12, item 6). Synthetic rounds whose confidence head is over-confident by a known
factor: the refit must soften it and beat the raw ECE; `apply` must write what `score` fitted."""

import json

import numpy as np

from dspark.core.calibration import STS, calibration_report
from dspark.perf import sts_refit

GAMMA = 7


def _rounds(n: int, seed: int) -> dict[str, np.ndarray]:
    """Rounds whose true per-slot acceptance is σ(z / 3): raw σ(z) is over-confident."""
    rng = np.random.default_rng(seed)
    z = rng.normal(1.5, 2.0, size=(n, GAMMA))
    ok = rng.random((n, GAMMA)) < 1.0 / (1.0 + np.exp(-z / 3.0))
    accepted = np.where(ok.all(axis=1), GAMMA, np.argmin(ok, axis=1))
    return {"logits": z, "accepted": accepted, "verified": np.full(n, GAMMA)}


def _drafter(tmp_path):
    d = tmp_path / "dspark"
    d.mkdir()
    meta = {"config": {"kind": "dspark"}, "sts": STS.identity(GAMMA).to_dict()}
    (d / "drafter.json").write_text(json.dumps(meta))
    return d


def test_score_and_apply_refit_an_overconfident_head(tmp_path, capsys):
    traces = []
    for t, seed in ((0.0, 1), (1.0, 2)):
        f = tmp_path / f"rollouts-T{t:g}.npz"
        np.savez(f, **_rounds(3000, seed), temperature=t)
        traces.append(str(f))
    evals = tmp_path / "evals"
    evals.mkdir()
    r = _rounds(2000, 3)
    np.savez(evals / "dspark-humaneval-T0.rounds.npz", **r)
    drafter = _drafter(tmp_path)
    out = tmp_path / "refit.json"

    assert (
        sts_refit.main(
            ["score", *traces, "--drafter", str(drafter), "--evals", str(evals), "--json", str(out)]
        )
        == 0
    )
    res = json.loads(out.read_text())
    assert res["rounds"] == {"refit-all": 6000, "refit-T0": 3000, "refit-T1": 3000}
    (cell,) = res["cells"]
    assert (cell["set"], cell["T"]) == ("humaneval", 0)
    assert cell["shipped"] == cell["raw"]  # the identity STS changes nothing
    assert cell["refit-all"] < cell["raw"] / 2
    assert min(res["temperatures"]["refit-all"][:4]) > 1.5  # softened (true factor 3) where rows are many
    assert "refit-all" in capsys.readouterr().out
    assert [c["file"] for c in res["cross_fit"]] == traces  # each file scored by the fit on the other

    assert sts_refit.main(["apply", *traces, "--drafter", str(drafter)]) == 0
    written = STS.from_dict(json.loads((drafter / "drafter.json").read_text())["sts"])
    assert list(written.temperatures) == res["temperatures"]["refit-all"]
    rep = calibration_report(r["logits"], r["accepted"], r["verified"], written)
    assert np.isclose(rep["ece_sts"], cell["refit-all"])


def test_sts_slices_split_the_held_out_prompts_once_each():
    from dspark.training.evaluate import sts_prompts, sts_slices

    assert sts_slices(240) == [(0, 120, 1.0), (120, 120, 0.0)]  # dspark train's default
    held = [{"prompt_ids": [i]} for i in range(50)]
    slices = sts_slices(45, (1.0, 0.0, 0.5))
    assert [n for _, n, _ in slices] == [15, 15, 15]
    got = [p[0] for s, n, _ in slices for p in sts_prompts(held, s, n)]
    assert len(set(got)) == 45  # disjoint
    assert got[:15] != list(range(15))  # a seeded order, not the file's (pool by pool)
    assert got == [p[0] for p in sts_prompts(held, 0, 45)]  # the slices of one order
