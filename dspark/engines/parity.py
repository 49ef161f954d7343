"""Parity gates for the GPU runtimes, device-generic (the unit tests run them on device cpu).

Two gates, both against the PyTorch oracle on the same device with TF32 off:

* graph gate (`graph_parity`): every engine on the inputs it was verified with at build time,
  outputs compared with the PyTorch module's: logits |Δ| within the precision's tolerance (and
  the same argmax in fp32); other outputs within the tolerance times their scale. Cases with an
  empty input are skipped (the runners never send one; TensorRT profiles start at 1).
* greedy gate (`greedy_parity`): whole generations through the reference loop (target + drafter
  engines vs the PyTorch runtime) on real prompts. Equal tokens pass. At the first divergence
  the report gives the position, both tokens and the oracle's top-2 logit gap there: a gap
  within the precision's near-tie bound is a flip of a near-tie (reported, not a failure: a
  different summation order can do it), a larger one is a bug (a failure).
"""

from __future__ import annotations

import torch

from dspark.core.interfaces import Request
from dspark.core.reference import generate
from dspark.core.scheduler import policy_for

# the first GPU run calibrates these (README, "GPU"): fp32 as on the CPU; fp16 relative to scale
TOLERANCE = {"fp32": 1e-3, "fp16": 2e-2}
NEAR_TIE = {"fp32": 5e-3, "fp16": 0.25}  # top-2 logit gap below which a greedy flip is a near-tie


def graph_parity(graph, module, examples, names, precision: str, what: str) -> dict:
    """Compare `graph` (any runtime) with the PyTorch `module` on `examples` (tuples of inputs
    in names[0] order). Returns {cases, skipped, max_abs_diff_logits, worst, ok, problems}."""
    from dspark.engines.runtimes import TorchGraph

    tol = TOLERANCE[precision]
    ref = TorchGraph(module, names[0], names[1], graph.device)
    report = {"cases": 0, "skipped": 0, "max_abs_diff_logits": 0.0, "worst_relative": 0.0, "problems": []}
    for i, ex in enumerate(examples):
        if any(x.numel() == 0 for x in ex):
            report["skipped"] += 1
            continue
        feed = dict(zip(names[0], [x.float() if x.is_floating_point() else x for x in ex]))
        want = ref.run(None, feed)
        got = graph.run(None, feed)
        report["cases"] += 1
        for name, g, e in zip(names[1], got, want):
            g, e = g.float().cpu(), e.float().cpu()
            if g.shape != e.shape:
                report["problems"].append(
                    f"{what} case {i}: {name} has shape {list(g.shape)}, PyTorch {list(e.shape)}"
                )
                continue
            if not g.numel():
                continue
            d = float((g - e).abs().max())
            scale = max(1.0, float(e.abs().max()))
            if "logits" in name:
                report["max_abs_diff_logits"] = max(report["max_abs_diff_logits"], d)
                limit = tol if precision == "fp32" else tol * scale
                if precision == "fp32" and not torch.equal(g.argmax(-1), e.argmax(-1)):
                    report["problems"].append(f"{what} case {i}: argmax of {name} differs from PyTorch")
            else:
                limit = tol * scale
            report["worst_relative"] = max(report["worst_relative"], d / scale)
            if d > limit:
                report["problems"].append(
                    f"{what} case {i}: {name} differs from PyTorch by {d:.2e} > {limit:.1e}"
                )
    report["ok"] = not report["problems"]
    return report


def top2_gap(logits: torch.Tensor) -> float:
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def greedy_parity(
    reference,
    candidate,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_ids: frozenset[int],
    oracle_step,
    near_tie: float,
    mode: str = "static:4",
) -> dict:
    """Greedy generations of `candidate` = (target runner, drafter or None) against `reference`
    (the PyTorch runtime), both through dspark.core.reference.generate. `oracle_step(ids)` gives
    the oracle's next-token logits after token ids `ids` (a fresh prefill), for the top-2 gap at
    the first divergence. Returns {ok, equal, prompts: [...]}"""
    reqs = [Request(list(p), max_tokens=max_new_tokens, stop_ids=stop_ids) for p in prompts]
    policy = policy_for(mode)
    ref = generate(reference[0], reqs, drafter=reference[1], policy=policy if reference[1] else None)
    got = generate(candidate[0], reqs, drafter=candidate[1], policy=policy if candidate[1] else None)
    rows, ok = [], True
    for i, (p, a, b) in enumerate(zip(prompts, ref, got)):
        row: dict = {
            "prompt": i,
            "prompt_tokens": len(p),
            "tokens": len(a.tokens),
            "equal": a.tokens == b.tokens,
        }
        if not row["equal"]:
            k = next(
                (j for j, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y),
                min(len(a.tokens), len(b.tokens)),
            )
            gap = top2_gap(oracle_step(list(p) + a.tokens[:k]))
            row["first_divergence"] = {
                "position": k,
                "reference_token": a.tokens[k] if k < len(a.tokens) else None,
                "candidate_token": b.tokens[k] if k < len(b.tokens) else None,
                "reference_top2_gap": gap,
                "near_tie": gap <= near_tie,
            }
            ok = ok and gap <= near_tie
        rows.append(row)
    equal = sum(r["equal"] for r in rows)
    return {"ok": ok, "equal": equal, "total": len(rows), "near_tie_bound": near_tie, "prompts": rows}


def oracle_step_fn(make_runner):
    """oracle_step for greedy_parity from a factory of fresh 1-slot target runners."""

    def step(ids: list[int]) -> torch.Tensor:
        runner = make_runner()
        slot = runner.allocate()
        out = runner.step([slot], [ids], last_only=True)
        runner.release(slot)
        return out.logits[0, -1]

    return step


def summarize(graph_reports: dict, greedy: dict | None) -> dict:
    bad = [f for f, r in graph_reports.items() if not r["ok"]]
    return {
        "ok": not bad and (greedy is None or all(g["ok"] for g in greedy.values())),
        "graphs_failed": bad,
        "graphs": graph_reports,
        "greedy": greedy,
        "max_abs_diff_logits": max((r["max_abs_diff_logits"] for r in graph_reports.values()), default=0.0),
    }
