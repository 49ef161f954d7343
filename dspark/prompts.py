"""Prompts: what the demo, the benchmark and the tests send.

Two sources, never silently substituted for each other:
  data/prompts/eval-sample.jsonl   in the repository: the first 8 prompts of each eval set
                                   (gsm8k-test → math, humaneval → code, mt-bench → chat), so a
                                   fresh clone with nothing beside it runs `make demo` and `make test`
  ../shared/data/eval/<set>.jsonl  the full eval sets beside the checkout (DSPARK_SHARED), used
                                   when present (benchmarks, acceptance evaluation)
Records are `{"turns": ["first user turn", ...]}`; only the first turn is used.
"""

from __future__ import annotations

import json
from pathlib import Path

from dspark.paths import REPO, shared_dir

EVAL_SETS = {"gsm8k-test": "math", "humaneval": "code", "mt-bench": "chat"}
SAMPLE = REPO / "data" / "prompts" / "eval-sample.jsonl"


class PromptsError(FileNotFoundError):
    """A prompt file is missing or too short; the message says where prompts come from."""


def first_turn(path: Path, index: int = 0) -> str:
    with path.open() as f:
        for i, line in enumerate(f):
            if i == index:
                return json.loads(line)["turns"][0]
    raise IndexError(f"{path} has no record {index}")


def _sample() -> list[dict]:
    if not SAMPLE.exists():
        raise PromptsError(
            f"{SAMPLE} is missing: it ships with the repository (git checkout -- data/prompts)"
        )
    with SAMPLE.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def eval_prompts(set_name: str, n: int, source: str = "auto") -> list[str]:
    """The first n first turns of an eval set. source: "shared" (../shared/data/eval, an error if
    absent), "repo" (the in-repository sample, at most 8 per set) or "auto" (shared when present,
    else the sample)."""
    if set_name not in EVAL_SETS:
        raise ValueError(f"unknown eval set {set_name!r}: choose one of {sorted(EVAL_SETS)}")
    full = shared_dir() / "data" / "eval" / f"{set_name}.jsonl"
    if source == "shared" or (source == "auto" and full.exists()):
        if not full.exists():
            raise PromptsError(
                f"{full} not found: put the shared data beside the checkout or set DSPARK_SHARED "
                "(the in-repository sample has only 8 prompts per set)"
            )
        with full.open() as f:
            out = [json.loads(line)["turns"][0] for _, line in zip(range(n), f)]
    else:
        out = [r["turns"][0] for r in _sample() if r["set"] == set_name][:n]
    if len(out) < n:
        raise PromptsError(
            f"{set_name}: {n} prompts asked, {len(out)} available"
            + ("" if full.exists() else f" (in-repository sample; the full set is {full})")
        )
    return out


def demo_prompts(per_domain: int = 2) -> list[tuple[str, str]]:
    """(domain, prompt) pairs for `make demo`: `per_domain` real prompts of each eval set, from
    the in-repository sample (the same prompts with or without ../shared)."""
    recs = _sample()
    out = []
    for set_name, domain in EVAL_SETS.items():
        chosen = [r["turns"][0] for r in recs if r["set"] == set_name][:per_domain]
        if len(chosen) < per_domain:
            raise PromptsError(f"{SAMPLE} has {len(chosen)} {set_name} prompts, {per_domain} needed")
        out += [(domain, p) for p in chosen]
    return out
