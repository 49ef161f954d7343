"""`make engines PROFILE=gpu`: TensorRT plans from the build's ONNX graphs, then the parity gates
on the GPU (engines/parity.py), recorded in manifest.json and parity.json.

Needs a GPU, a CUDA build of torch and the tensorrt package (RuntimeUnavailable otherwise; the
CLI turns that into a non-zero exit, never into a CPU build that claims success). TF32 is off
everywhere here: the oracle is PyTorch fp32 on the same GPU.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import torch

from dspark.engines.parity import NEAR_TIE, graph_parity, greedy_parity, oracle_step_fn, summarize
from dspark.engines.runtimes import (
    OrtGraph,
    RuntimeSpec,
    RuntimeUnavailable,
    onnx_file,
    ort_session,
    require_cuda,
    set_tf32,
    target_graph,
    torch_drafter_graphs,
    torch_target_graph,
)
from dspark.engines.tensorrt import PlanSettings, TrtGraph, build_plans, gpu_info, require_tensorrt


def f32_drafter(model):
    m = copy.deepcopy(model).float().eval()
    m.embed, m.lm_head = model.embed.float(), model.lm_head.float()
    return m


def build_gpu(
    b,
    target,
    drafter,
    settings: PlanSettings,
    precisions: list[str],
    prompts: list[list[int]],
    device: str = "cuda:0",
    max_new_tokens: int = 48,
    ort_cuda: bool = True,
) -> dict:
    """Plans for every ONNX engine of the Builder `b` (after build_target / build_drafter), the
    graph gate for each plan (and for ONNX Runtime's CUDA provider), the greedy gate per runtime
    on `prompts` (token ids). Returns the parity summary (summary["ok"])."""
    require_tensorrt()
    dev = require_cuda(device)
    set_tf32(False)
    t0 = time.time()
    plans = build_plans(b, settings, precisions, str(dev))
    reports: dict = {}
    for e in plans:
        module, examples, names = b.sources[e["onnx"]]
        graph = TrtGraph(b.out / e["plan"], dev, e)
        r = graph_parity(graph, copy.deepcopy(module), examples, names, e["precision"], e["file"])
        e["verified"] = {k: r[k] for k in ("cases", "skipped", "max_abs_diff_logits", "worst_relative", "ok")}
        reports[e["file"]] = r
        verdict = "ok" if r["ok"] else "FAILED: " + "; ".join(r["problems"][:3])
        b.log(f"[parity] {e['file']}: {verdict} (max |Δ| logits {r['max_abs_diff_logits']:.1e})")
        del graph
    if ort_cuda:
        spec = RuntimeSpec("ort", str(dev))
        for e in [e for e in b.engines if e.get("backend") == "onnxruntime" and e["file"] in b.sources]:
            module, examples, names = b.sources[e["file"]]
            graph = OrtGraph(ort_session(onnx_file(b.out, e["file"], spec), spec), dev)
            reports[f"{e['file']} (ort cuda)"] = graph_parity(
                graph, copy.deepcopy(module), examples, names, "fp32", f"{e['file']} (ort cuda)"
            )
    torch.cuda.empty_cache()

    meta = json.loads((b.out / "drafter_meta.json").read_text())
    cfg = target.cfg
    positions = json.loads((b.out / "target_meta.json").read_text()).get("rope_positions")
    rows, max_len = len(prompts), max(len(p) for p in prompts) + max_new_tokens + 16
    from dspark.engines.ort import OrtDrafterRunner, OrtTargetRunner

    oracle_target = torch_target_graph(copy.deepcopy(target), dev)
    oracle_drafter = torch_drafter_graphs(f32_drafter(drafter), meta, dev)

    def reference():
        return OrtTargetRunner(oracle_target, cfg, rows, max_len), OrtDrafterRunner(
            oracle_drafter, meta, rows
        )

    oracle = oracle_step_fn(lambda: OrtTargetRunner(oracle_target, cfg, 1, max_len))
    stop = frozenset(cfg.eos_token_ids)
    greedy = {}
    specs = [RuntimeSpec("tensorrt", str(dev), precision=p) for p in precisions]
    specs += [RuntimeSpec("ort", str(dev))] if ort_cuda else []
    for spec in specs:
        name = f"{spec.runtime}-{spec.precision}" if spec.runtime == "tensorrt" else "ort-cuda"
        cand = (
            OrtTargetRunner(target_graph(b.out, spec), cfg, rows, max_len, positions),
            OrtDrafterRunner.open(b.out, spec, rows),
        )
        near = NEAR_TIE[spec.precision]
        greedy[name] = greedy_parity(reference(), cand, prompts, max_new_tokens, stop, oracle, near)
        g = greedy[name]
        b.log(f"[parity] greedy {name}: {g['equal']}/{g['total']} prompts equal to the torch runtime"
              + ("" if g["ok"] else " — a divergence beyond a near-tie: FAILED"))  # fmt: skip
        del cand
        torch.cuda.empty_cache()
    summary = summarize(reports, greedy)
    summary["seconds"] = round(time.time() - t0, 1)
    b.tensorrt = {
        "built": True,
        "version": require_tensorrt().__version__,
        "gpu": gpu_info(dev),
        "precisions": precisions,
        "settings": settings.to_dict(),
        "tf32": False,
        "plans": [e["file"] for e in plans],
        "parity_ok": summary["ok"],
    }
    (Path(b.out) / "parity.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def gpu_ready() -> tuple[bool, str]:
    """(can build plans here, why not)."""
    try:
        require_tensorrt()
        require_cuda("cuda")
    except RuntimeUnavailable as e:
        return False, str(e)
    return True, ""
