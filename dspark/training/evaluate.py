"""Offline acceptance evaluation (reference notes §6): fixed γ chain drafting, no scheduler.

Every prompt (first turn of a {"turns": [...]} record, chat template, no system prompt added
by us) goes through the reference loop with the `static:γ` policy, so every round verifies the
whole block, and the per-round traces give τ, survival, conditional acceptance and, for drafters
with a confidence head, the calibration of prefix survival before and after STS.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dspark.core.calibration import STS, calibration_report
from dspark.core.interfaces import Drafter, Request, RoundTrace
from dspark.core.metrics import AcceptanceStats
from dspark.core.reference import generate
from dspark.core.sampling import SamplingParams
from dspark.core.scheduler import Static
from dspark.models.loading import LoadedTarget
from dspark.models.target import TargetRunner


@dataclass
class EvalConfig:
    limit: int | None = None
    max_new_tokens: int = 256
    temperature: float = 0.0
    seed: int = 980406
    batch: int = 4
    max_prompt_tokens: int = 1536


def read_first_turns(path: Path, limit: int | None, seed: int) -> list[str]:
    """First turns of a JSONL file; a seeded random subset of `limit` when the file is larger."""
    with path.open() as f:
        turns = [json.loads(line)["turns"][0] for line in f if line.strip()]
    if limit is not None and limit < len(turns):
        idx = list(range(len(turns)))
        random.Random(seed).shuffle(idx)
        turns = [turns[i] for i in sorted(idx[:limit])]
    return turns


def traces_to_arrays(traces: list[RoundTrace], gamma: int):
    """(logits [N, γ], accepted [N], verified [N]) for calibration; an accepted stop token ends
    the effective proposal there (reference notes §3)."""
    if not traces:
        return np.zeros((0, gamma)), np.zeros(0, dtype=int), np.zeros(0, dtype=int)
    logits = np.stack([t.conf_logits for t in traces]).astype(np.float64)
    accepted = np.array([t.accepted for t in traces])
    verified = np.array([min(t.verified, t.accepted) if t.stopped else t.verified for t in traces])
    return logits, accepted, verified


def evaluate(
    loaded: LoadedTarget,
    drafter: Drafter,
    prompts: list[str],
    cfg: EvalConfig,
    sts: STS | None = None,
    progress: bool = True,
    target_factory=None,
) -> tuple[dict, dict]:
    """Returns the result JSON and the per-round arrays (confidence logits, accepted, verified, and
    the index of the request each round belongs to; a request's rounds are contiguous).

    target_factory(num_slots, max_len) may supply another Target (the ORT engine: `--engines`)."""
    from tqdm import tqdm

    gamma = drafter.block_size
    max_len = cfg.max_prompt_tokens + cfg.max_new_tokens + gamma + 2
    if target_factory is not None:
        runner = target_factory(cfg.batch, max_len)
    else:
        runner = TargetRunner(loaded.model, num_slots=cfg.batch, max_len=max_len)
    stats, traces, new_tokens, skipped = AcceptanceStats(), [], 0, 0
    request: list[int] = []  # which request each round belongs to (for per-request replays)
    n_done = 0
    reqs = []
    for i, text in enumerate(prompts):
        ids = loaded.chat_ids(text)
        if len(ids) > cfg.max_prompt_tokens:
            skipped += 1
            continue
        params = SamplingParams(temperature=cfg.temperature, seed=cfg.seed + i)
        reqs.append(Request(ids, max_tokens=cfg.max_new_tokens, params=params, stop_ids=loaded.stop_ids))
    t0 = time.perf_counter()
    bar = tqdm(total=len(reqs), unit="prompt", disable=not progress, dynamic_ncols=True)
    for b in range(0, len(reqs), cfg.batch):
        for res in generate(runner, reqs[b : b + cfg.batch], drafter=drafter, policy=Static(gamma)):
            stats.merge(res.stats)
            request.extend([n_done] * len(res.trace))
            n_done += 1
            traces.extend(res.trace)
            new_tokens += len(res.tokens)
        bar.update(len(reqs[b : b + cfg.batch]))
        bar.set_postfix_str(f"τ {stats.tau:.2f}")
    bar.close()
    out = {
        "prompts": len(reqs),
        "skipped_long_prompts": skipped,
        "new_tokens": new_tokens,
        "seconds": time.perf_counter() - t0,
        "temperature": cfg.temperature,
        "gamma": gamma,
        **stats.to_json_dict(gamma),
    }
    logits, accepted, verified = traces_to_arrays(traces, gamma)
    if np.any(logits != 0):  # drafters without a confidence head report zeros
        report = calibration_report(logits, accepted, verified, sts)
        out["ece_raw"], out["ece_sts"] = report["ece_raw"], report["ece_sts"]
        out["calibration"] = report
    request_of_round = np.array(request, dtype=np.int64)
    return out, {"logits": logits, "accepted": accepted, "verified": verified, "request": request_of_round}


STS_PROMPTS = 240
"""Held-out prompts `dspark train` fits DSpark's STS on (~11 min of rollouts per 120 at one thread)."""
STS_TEMPERATURES = (1.0, 0.0)
"""The temperatures of the STS rollouts, one slice of the held-out prompts each (issue 12, item 6:
the eval sets are scored at both, and a fit on one temperature alone calibrates the other worse)."""


def sts_slices(count: int, temperatures=STS_TEMPERATURES) -> list[tuple[int, int, float]]:
    """(start, count, T) per temperature: `count` held-out prompts split in order, T_1 first."""
    n = len(temperatures)
    bounds = [count * i // n for i in range(n + 1)]
    return [(bounds[i], bounds[i + 1] - bounds[i], float(t)) for i, t in enumerate(temperatures)]


def sts_prompts(held: list[dict], start: int, count: int, order: int = 0) -> list[list[int]]:
    """Held-out prompts start..start+count in a seeded order, so that every slice mixes the pools
    (the held-out records come pool by pool)."""
    idx = np.random.default_rng(order).permutation(len(held))
    return [held[i]["prompt_ids"] for i in idx[start : start + count]]


def sts_rollouts(
    loaded: LoadedTarget,
    drafter: Drafter,
    held: list[dict],
    start: int,
    count: int,
    temperature: float,
    max_new_tokens: int = 128,
) -> list[RoundTrace]:
    """One slice of the STS rollouts (`sts_slices`): `dspark train` runs every slice in turn,
    `python -m dspark.perf.sts_refit rollouts` one per process; both give the same rounds."""
    from dspark.models.runners import runner_for

    prompts = sts_prompts(held, start, count)
    if not prompts:
        return []
    runner = runner_for(drafter, 4, 2048)
    return rollout_traces(loaded, runner, prompts, max_new_tokens, temperature=temperature, seed=start)


def fit_sts_on_traces(traces: list[RoundTrace], gamma: int) -> STS:
    logits, accepted, verified = traces_to_arrays(traces, gamma)
    return STS.fit(logits, accepted, verified)


def rollout_traces(
    loaded: LoadedTarget,
    drafter: Drafter,
    prompt_ids: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    seed: int = 0,
    batch: int = 4,
) -> list[RoundTrace]:
    """Speculative rollouts (static:γ) on held-out prompts: the data STS is fitted on."""
    gamma = drafter.block_size
    runner = TargetRunner(
        loaded.model, num_slots=batch, max_len=max(map(len, prompt_ids)) + max_new_tokens + gamma + 2
    )
    traces = []
    reqs = [
        Request(
            ids,
            max_tokens=max_new_tokens,
            params=SamplingParams(temperature=temperature, seed=seed + i),
            stop_ids=loaded.stop_ids,
        )
        for i, ids in enumerate(prompt_ids)
    ]
    with torch.no_grad():
        for b in range(0, len(reqs), batch):
            for res in generate(runner, reqs[b : b + batch], drafter=drafter, policy=Static(gamma)):
                traces.extend(res.trace)
    return traces
