"""The offline planner replay (dspark/perf/skip_sim.py) on synthetic recordings."""

import numpy as np

from dspark.core.sps import SPSTable
from dspark.perf.skip_sim import Replay

SHAPE = (np.array([1.0, 64.0]), np.array([1.0, 8.0]))


def _traces(conf: float, accepted: int, tokens: int = 64) -> list[dict]:
    rounds, c = [], 1
    while c < tokens:
        rounds.append({"at": c, "accepted": accepted, "conf": [conf] * 7})
        c += accepted + 1
    return [
        {"set": s, "prompt": 0, "tokens": tokens, "rounds": rounds}
        for s in ("gsm8k-test", "humaneval", "mt-bench")
    ]


def test_replay_gains_where_drafts_are_accepted_and_never_loses_much_where_they_are_not():
    sps = SPSTable.from_step_times([1, 8, 64], [0.030, 0.036, 0.080])
    good = Replay(_traces(0.95, 7), sps, 30.0, 5.0, SHAPE)
    off, _ = good.run(1, "off", 6, 64)
    always, _ = good.run(1, "always", 6, 64)
    skip, share = good.run(1, "skip", 6, 64)
    assert always / off > 3 and skip / off > 3 and share > 0.9
    bad = Replay(_traces(0.9, 0), sps, 30.0, 15.0, SHAPE)  # confident, never accepted
    off, _ = bad.run(8, "off", 80, 64)
    always, _ = bad.run(8, "always", 80, 64)
    skip, _ = bad.run(8, "skip", 80, 64)
    blind, _ = bad.run(8, "skip", 80, 64, observe=False)
    assert always / off < 0.8
    assert skip / off > blind / off and skip / off > 0.9
