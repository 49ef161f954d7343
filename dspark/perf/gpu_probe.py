"""`python -m dspark.perf.gpu_probe`: what a bare, offline GPU machine can check of the GPU half.

`make gpu-check` needs TensorRT, onnxruntime-gpu, tritonserver and the SmolLM2 checkpoint (GBs of
wheels and 540 MB of weights). A lent GPU machine that has only CUDA PyTorch, no network and a
64 MiB upload cannot hold those, so this probe checks what it can with what travels in the
checkout (the shipped drafters, drafter_meta.json of a CPU build) and PyTorch alone:

  env       GPU, driver, torch/CUDA, whether TensorRT / onnxruntime-gpu / tritonserver are there
  lossless  the torch runtime on the GPU (device-resident KV and drafter slots, the same runners
            the gpu profile serves) with a SmolLM2-135M-*shaped* target of random weights (seeded,
            final norm sharpened like the tests' tiny target) and the shipped DSpark drafter:
            greedy off / static:7 / dspark on the GPU equal the PyTorch target on the CPU, token
            for token; a divergence is reported with the oracle's top-2 logit gap (a near-tie)
  timing    the target step on the GPU (torch runtime, fp32, TF32 off): decode steps/s per batch
            size B (an SPS(B) curve), the cost of a verify of 1..8 tokens relative to a 1-token
            step, and one draft round of the DSpark drafter at B = 1 and 16

Random weights make acceptance meaningless (τ is not reported); step and round times do not depend
on the weights' values. Writes OUT/gpu_probe.json and OUT/gpu_probe.md; exit 1 on a divergence
that is not a near-tie, 2 without a GPU (unless --device cpu, which the unit test uses).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from dspark.paths import REPO

# SmolLM2-135M-Instruct's shape (the default target's dspark_target.json)
SMOLLM2_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rms_eps=9.999999747378752e-06,
    rope_theta=100000.0,
    tie_embeddings=True,
    feature_layers=(1, 8, 14, 20, 27),
    bos_token_id=1,
    eos_token_ids=(2,),
)
NEAR_TIE = 1e-3  # a top-2 logit gap below this may flip between devices: reported, not failed


def env_info(device: str) -> dict:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "device": device,
        "tensorrt": importlib.util.find_spec("tensorrt") is not None,
        "onnxruntime_providers": _ort_providers(),
        "tritonserver_on_path": shutil.which("tritonserver") is not None,
    }
    if device.startswith("cuda"):
        p = torch.cuda.get_device_properties(torch.device(device))
        info |= {
            "gpu": p.name,
            "capability": f"{p.major}.{p.minor}",
            "memory_gib": round(p.total_memory / 2**30, 1),
        }
        try:
            q = "--query-gpu=driver_version"
            info["driver"] = subprocess.run(
                ["nvidia-smi", q, "--format=csv,noheader"], capture_output=True, text=True, timeout=20
            ).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            info["driver"] = None
    return info


def _ort_providers() -> list[str]:
    try:
        import onnxruntime

        return onnxruntime.get_available_providers()
    except ImportError:
        return []


def build(drafter_dir: Path, meta_path: Path | None, shape: dict, seed: int):
    """(target config, the random target (the CPU oracle), the PyTorch drafter attached to it, meta)."""
    from dspark.models.block_drafter import BlockDrafter
    from dspark.models.target import LlamaTarget, TargetConfig

    cfg = TargetConfig(**shape)
    target = LlamaTarget.random(cfg, seed=seed, dtype=torch.float32).eval()
    with torch.no_grad():
        target.model.norm.weight.mul_(4.0)  # peaked next-token distributions, like a trained LM's
    drafter = BlockDrafter.load(drafter_dir).float()
    drafter.attach(target.model.embed_tokens.weight, target.lm_head.weight)
    meta = json.loads(meta_path.read_text()) if meta_path else runtime_meta(drafter)
    return cfg, target, drafter, meta


def runtime_meta(m, buckets=(1, 2, 4, 8, 16, 32, 64), max_context: int = 2048) -> dict:
    """The parts of a build's drafter_meta.json the torch runtime reads, from the drafter itself
    (the same values dspark.engines.build writes; no ONNX file is needed by the torch runtime)."""
    from dspark.export import drafter as ex

    files = {"drafter_context": "torch", "drafter_backbone": {str(b): "torch" for b in buckets}}
    if m.cfg.head != "none":
        files["drafter_head"] = {str(b): "torch" for b in buckets}
    return {
        "config": m.cfg.to_dict(),
        "draft_vocab": m.draft_vocab.tolist(),
        "target_vocab_size": int(m.embed.shape[0]),
        "max_context": max_context,
        "new_positions": m.cfg.block_size + 1,
        "buckets": list(buckets),
        "context_buckets": ex.context_buckets(max_context),
        "files": files,
    }


def _requests(cfg, n: int, max_tokens: int, seed: int):
    from dspark.core.interfaces import Request

    g = torch.Generator().manual_seed(seed)
    lens = [int(x) for x in torch.randint(8, 120, (n,), generator=g)]
    prompts = [torch.randint(3, cfg.vocab_size, (k,), generator=g).tolist() for k in lens]
    return [Request(p, max_tokens=max_tokens, stop_ids=frozenset(cfg.eos_token_ids)) for p in prompts]


def _top2_gap(target, ids: list[int]) -> float:
    from dspark.models.target import TargetRunner

    runner = TargetRunner(target, 1, len(ids) + 1)
    logits = runner.step([runner.allocate()], [ids], last_only=True).logits[0, -1].double()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def lossless(cfg, target, drafter, meta, device: str, n: int, max_tokens: int, seed: int) -> dict:
    from dspark.core.reference import generate
    from dspark.core.scheduler import policy_for
    from dspark.core.sps import SPSTable
    from dspark.engines.ort import OrtDrafterRunner, OrtTargetRunner
    from dspark.engines.runtimes import torch_drafter_graphs, torch_target_graph
    from dspark.models.target import TargetRunner

    reqs = _requests(cfg, n, max_tokens, seed)
    max_len = max(len(r.prompt_ids) for r in reqs) + max_tokens + 16
    t0 = time.perf_counter()
    oracle = [r.tokens for r in generate(TargetRunner(target, n, max_len), reqs)]
    out = {
        "prompts": n,
        "max_tokens": max_tokens,
        "oracle_s": round(time.perf_counter() - t0, 2),
        "modes": {},
    }
    sps = SPSTable.from_step_times([1, 64], [1.0, 1.0 + 0.01 * 63])
    t_graph = torch_target_graph(target, device)
    d_graphs = torch_drafter_graphs(drafter, meta, device)
    failed = False
    for mode in ("off", "static:7", "dspark"):
        t = OrtTargetRunner(t_graph, cfg, n, max_len)
        d = OrtDrafterRunner(d_graphs, meta, n)
        t0 = time.perf_counter()
        res = generate(t, reqs, drafter=None if mode == "off" else d, policy=policy_for(mode, sps))
        secs = time.perf_counter() - t0
        got = [r.tokens for r in res]
        diverged = []
        for i, (a, b) in enumerate(zip(got, oracle)):
            if a != b:
                k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                gap = _top2_gap(target, list(reqs[i].prompt_ids) + b[:k])
                diverged.append(
                    {"request": i, "position": k, "oracle_top2_gap": gap, "near_tie": gap < NEAR_TIE}
                )
        failed |= any(not x["near_tie"] for x in diverged)
        out["modes"][mode] = {
            "equal": not diverged,
            "diverged": diverged,
            "seconds": round(secs, 2),
            "tokens": sum(len(x) for x in got),
            "verified_tokens": sum(r.stats.verified_tokens for r in res),
            "slots_free_after": [t.cache.free_slots, d.free_slots],
        }
    out["ok"] = not failed
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def _cuda_graph_ms(graph, feed: dict, timed) -> float | str:
    """The target graph's call captured as a CUDA graph (these shapes only) and replayed: what the
    step costs once kernel launches stop dominating. A string: why it could not be captured."""
    args = [feed[n] for n in graph.input_names if n in feed]
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.no_grad(), graph.device:
            for _ in range(3):
                graph.module(*args)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g), torch.no_grad(), graph.device:
            graph.module(*args)
        return round(timed(g.replay) * 1e3, 3)
    except Exception as e:  # noqa: BLE001 - an op that cannot be captured is a finding, not a crash
        return f"not captured: {type(e).__name__}: {str(e)[:200]}"


def _profile(fn, device: str, steps: int = 5, top: int = 15) -> list[dict]:
    """torch.profiler over `steps` calls of fn: the ops with the most self time (CPU and device)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    fn()
    with profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
        _sync(device)
    rows = []
    for e in prof.key_averages():
        dev = getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))
        rows.append(
            {
                "op": e.key,
                "calls_per_step": e.count / steps,
                "self_cpu_ms_per_step": round(e.self_cpu_time_total / 1e3 / steps, 3),
                "self_device_ms_per_step": round(dev / 1e3 / steps, 3),
            }
        )
    rows.sort(key=lambda r: -(r["self_cpu_ms_per_step"] + r["self_device_ms_per_step"]))
    return rows[:top]


def timing(
    cfg, target, drafter, meta, device: str, sizes, context: int, reps: int, with_profile=False
) -> dict:
    from dspark.core.interfaces import SamplingParams
    from dspark.core.sampling import make_generator
    from dspark.engines.ort import OrtDrafterRunner, OrtTargetRunner
    from dspark.engines.runtimes import torch_drafter_graphs, torch_target_graph

    B_max = max(sizes)
    t = OrtTargetRunner(torch_target_graph(target, device), cfg, B_max, context + 16)
    g = torch.Generator().manual_seed(0)
    slots = [t.allocate() for _ in range(B_max)]
    prompt = torch.randint(3, cfg.vocab_size, (B_max, context), generator=g).tolist()
    for s, p in zip(slots, prompt):
        t.step([s], [p])

    def timed(fn) -> float:
        fn()
        _sync(device)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            _sync(device)
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[len(ts) // 2]

    def step(rows, n_tok):
        def fn():
            t.step(rows, [[5] * n_tok for _ in rows])
            for s in rows:
                t.rollback(s, context)

        return fn

    decode = {B: timed(step(slots[:B], 1)) for B in sizes}
    cuda_graph: dict = {}  # the same call captured once as a CUDA graph and replayed (fixed shapes)
    graph_only = {}  # the graph call alone on device-resident inputs: the step minus the runner's work
    for B, N in sorted({(1, 1), (1, 8), (16, 1), (16, 8), (B_max, 1), (B_max, 8)}):
        if B > B_max:
            continue
        idx = np.asarray(slots[:B], np.int64)
        past = t.cache.length[idx].copy()
        ids = np.full((B, N), 5, np.int64)
        pk, pv = t.cache.gather(idx, int(past.max()))
        feed = {
            "input_ids": torch.as_tensor(ids, device=device),
            "positions": torch.as_tensor(past[:, None] + np.arange(N)[None, :], device=device),
            "past_len": torch.as_tensor(past, device=device),
            "valid": torch.ones((B, N), dtype=torch.bool, device=device),
        }
        for i in range(cfg.num_layers):
            feed[f"past_key.{i}"], feed[f"past_value.{i}"] = pk[i], pv[i]
        key = f"B={B},N={N}"
        graph_only[key] = timed(lambda feed=feed: t.graph.run(None, feed))
        if device.startswith("cuda"):
            cuda_graph[key] = _cuda_graph_ms(t.graph, feed, timed)
    profile = _profile(lambda: step(slots[:1], 1)(), device) if with_profile else None
    verify = {n: timed(step(slots[:1], n)) for n in range(1, 9)}
    verify16 = {n: timed(step(slots[:16], n)) for n in (1, 2, 4, 8)} if B_max >= 16 else {}
    # one draft round (backbone + sequential head) of the shipped DSpark drafter
    d = OrtDrafterRunner(torch_drafter_graphs(drafter, meta, device), meta, B_max)
    feats = torch.randn(context, meta["config"]["feature_size"], generator=g)
    for rid in range(B_max):
        d.begin(rid, prompt[rid], feats)
    rounds = {}
    for B in (1, 16):
        if B > B_max:
            continue
        rids = list(range(B))
        params = [SamplingParams() for _ in rids]
        gens = [make_generator(0) for _ in rids]
        rounds[B] = timed(
            lambda rids=rids, params=params, gens=gens: d.propose(rids, [5] * len(rids), params, gens)
        )
    return {
        "context": context,
        "reps": reps,
        "decode_step_ms": {B: round(s * 1e3, 3) for B, s in decode.items()},
        "graph_call_ms": {B: round(s * 1e3, 3) for B, s in graph_only.items()},
        "cuda_graph_replay_ms": cuda_graph,
        "profile_b1": profile,
        "steps_per_s": {B: round(1 / s, 1) for B, s in decode.items()},
        "verify_ms_b1": {n: round(s * 1e3, 3) for n, s in verify.items()},
        "verify_cost_ratio_b1": {n: round(s / verify[1], 3) for n, s in verify.items()},
        "verify_ms_b16": {n: round(s * 1e3, 3) for n, s in verify16.items()},
        "draft_round_ms": {B: round(s * 1e3, 3) for B, s in rounds.items()},
    }


def markdown(res: dict) -> str:
    e = res["env"]
    trt = "present" if e["tensorrt"] else "absent"
    triton = "on PATH" if e["tritonserver_on_path"] else "absent"
    providers = ", ".join(e["onnxruntime_providers"]) or "none"
    lines = [
        f"# GPU probe ({res['date']})",
        "",
        f"{e.get('gpu', e['device'])}, driver {e.get('driver')}, "
        f"torch {e['torch']} (CUDA {e['torch_cuda']}), "
        f"Python {e['python']}; TensorRT {trt}, ONNX Runtime providers {providers}, tritonserver {triton}.",
        "Target: SmolLM2-135M-shaped, random weights (timing and losslessness only; no acceptance figure).",
        "",
    ]
    if "lossless" in res:
        ll = res["lossless"]
        lines += [
            f"## Greedy through the torch runtime on {e['device']} vs the PyTorch target on the CPU "
            f"({ll['prompts']} prompts × {ll['max_tokens']} tokens)",
            "",
            "| mode | equal | diverged (near-ties) | seconds |",
            "|---|---|---|---|",
        ]
        for m, r in ll["modes"].items():
            nt = sum(x["near_tie"] for x in r["diverged"])
            lines.append(f"| {m} | {r['equal']} | {len(r['diverged'])} ({nt}) | {r['seconds']} |")
        lines.append("")
    if "timing" in res:
        tm = res["timing"]
        lines += [
            f"## Target step, torch runtime fp32 (context {tm['context']}, median of {tm['reps']})",
            "",
            "| B | decode step ms | steps/s |",
            "|---|---|---|",
        ]
        for B, ms in tm["decode_step_ms"].items():
            lines.append(f"| {B} | {ms} | {tm['steps_per_s'][B]} |")
        for key, what in (
            ("graph_call_ms", "Graph call alone (inputs already on the device)"),
            ("cuda_graph_replay_ms", "The same call captured as a CUDA graph and replayed"),
        ):
            if tm.get(key):
                lines += ["", f"{what}: " + ", ".join(f"{k}: {ms} ms" for k, ms in tm[key].items())]
        if tm.get("profile_b1"):
            lines += [
                "",
                "| op (decode step, B=1) | calls | self CPU ms | self device ms |",
                "|---|---|---|---|",
            ]
            for r in tm["profile_b1"]:
                lines.append(
                    f"| {r['op']} | {r['calls_per_step']:g} | {r['self_cpu_ms_per_step']} | "
                    f"{r['self_device_ms_per_step']} |"
                )
        lines += ["", "| tokens verified (B=1) | ms | × 1-token step |", "|---|---|---|"]
        for n, ms in tm["verify_ms_b1"].items():
            lines.append(f"| {n} | {ms} | {tm['verify_cost_ratio_b1'][n]} |")
        lines += [
            "",
            "Draft round (DSpark, backbone + Markov head): "
            + ", ".join(f"B={B}: {ms} ms" for B, ms in tm["draft_round_ms"].items()),
            "",
        ]
    for k in ("error_lossless", "error_timing"):
        if k in res:
            lines += [f"**{k}**: `{res[k].splitlines()[-1]}`", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--out", default="results/gpu")
    p.add_argument("--drafter", default=str(REPO / "drafters" / "dspark"))
    p.add_argument(
        "--meta", default="", help="a build's drafter_meta.json (default: derived from the drafter)"
    )
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--sizes", default="1,2,4,8,16,32,64")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="torch.profiler table of a decode step")
    p.add_argument("--skip", default="", help="phases to skip: lossless, timing")
    p.add_argument("--shape", default=None, help="JSON file with a TargetConfig (default: SmolLM2-135M's)")
    a = p.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_probe: torch sees no GPU here", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "env": env_info(a.device)}
    print(json.dumps(res["env"]), flush=True)
    shape = json.loads(Path(a.shape).read_text()) if a.shape else SMOLLM2_SHAPE
    cfg, target, drafter, meta = build(Path(a.drafter), Path(a.meta) if a.meta else None, shape, a.seed)

    def save():
        (out / "gpu_probe.json").write_text(json.dumps(res, indent=1))
        (out / "gpu_probe.md").write_text(markdown(res))

    import traceback

    for name, fn in (
        ("lossless", lambda: lossless(cfg, target, drafter, meta, a.device, a.prompts, a.max_tokens, a.seed)),
        (
            "timing",
            lambda: timing(
                cfg,
                target,
                drafter,
                meta,
                a.device,
                [int(x) for x in a.sizes.split(",")],
                a.context,
                a.reps,
                a.profile,
            ),
        ),
    ):
        if name in a.skip.split(","):
            continue
        t0 = time.perf_counter()
        try:
            res[name] = fn()
            res[name]["phase_s"] = round(time.perf_counter() - t0, 1)
        except Exception:  # noqa: BLE001 - a phase's failure is reported, the next phase still runs
            res[f"error_{name}"] = traceback.format_exc()
            print(res[f"error_{name}"], file=sys.stderr, flush=True)
        print(f"[gpu_probe] {name} done in {time.perf_counter() - t0:.1f} s", flush=True)
        save()
    print(markdown(res), flush=True)
    if any(k.startswith("error_") for k in res):
        return 1
    return 0 if res.get("lossless", {}).get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
