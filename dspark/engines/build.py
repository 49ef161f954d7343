"""`make engines` / `dspark engines`: checkpoints → ONNX → verified engines + manifest.json.

Layout of a build folder (default build/engines):

  target.onnx                 target step graph (dynamic R, N, S)      export/target.py
  target.opt.onnx             the same, optimized by ONNX Runtime (what the server loads)
  drafter_context.onnx        drafter context graph (dynamic)          export/drafter.py
  drafter_backbone.b{B}.onnx  one static graph per batch bucket B
  drafter_head.b{B}.onnx      one static graph per batch bucket B (DSpark only; DFlash has none)
  *.opt.onnx                  optimized versions of each
  drafter_meta.json           what the drafter runtime needs (config, draft vocabulary, buckets)
  reference/<role>.{inputs,outputs}.json   polygraphy reference data (PyTorch outputs)
  manifest.json               every engine: role, backend, file, shapes, dtypes, hashes, versions

Every graph is checked when built: onnx.checker, ORT vs PyTorch on random inputs
(max |Δ| ≤ 1e-3, identical argmax), and `polygraphy run --onnxrt` against saved PyTorch
reference outputs. The build is incremental: an engine is rebuilt only when its source
checkpoint, the export code or its build settings change.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dspark.engines.ort import session
from dspark.models.target import ROPE_TABLE_POSITIONS
from dspark.paths import REPO

TOL = 1e-3


@dataclass
class BuildConfig:
    buckets: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    max_context: int = 2048
    threads: int = 2
    verify: bool = True  # the checker / PyTorch / polygraphy gates

    def to_dict(self) -> dict:
        return {"buckets": self.buckets, "max_context": self.max_context, "threads": self.threads}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_tensors(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(module.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def code_hash() -> str:
    """Hash of the code an engine's content depends on (exporters and model definitions)."""
    h = hashlib.sha256()
    for rel in (
        "dspark/export/__init__.py",
        "dspark/export/target.py",
        "dspark/export/drafter.py",
        "dspark/models/target.py",
        "dspark/models/block_drafter.py",
    ):
        h.update((REPO / rel).read_bytes())
    return h.hexdigest()[:16]


def tool_versions() -> dict:
    import onnx
    import onnxruntime

    v = {"python": platform.python_version(), "torch": torch.__version__, "onnx": onnx.__version__}
    v["onnxruntime"] = onnxruntime.__version__
    try:
        import polygraphy

        v["polygraphy"] = polygraphy.__version__
    except ImportError:
        pass
    return v


def io_spec(path: Path) -> dict:
    """Inputs/outputs of an ONNX graph: name → {dtype, shape} (symbolic dims by name)."""
    import onnx

    m = onnx.load(str(path), load_external_data=False)

    def one(vi):
        t = vi.type.tensor_type
        dims = [d.dim_param or d.dim_value for d in t.shape.dim]
        return {"dtype": onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name, "shape": dims}

    return {
        "inputs": {i.name: one(i) for i in m.graph.input},
        "outputs": {o.name: one(o) for o in m.graph.output},
    }


# -- verification gates -----------------------------------------------------------------------


def compare(sess, feed: dict, expected: list[np.ndarray], names: list[str], what: str) -> float:
    """ORT outputs vs PyTorch; returns the max |Δ| of the logits outputs.

    Logits: max |Δ| ≤ TOL and identical argmax (the issue's gate). Other outputs (tapped
    features, hidden states, keys/values) carry the model's large activations (SmolLM2's
    intermediate features reach ~10^3), so they are held to TOL relative to their scale."""
    got = sess.run(None, feed)
    worst = 0.0
    for name, g, e in zip(names, got, expected):
        if g.shape != e.shape:
            raise AssertionError(f"{what}: output {name} has shape {g.shape}, PyTorch {e.shape}")
        if not g.size:
            continue
        d = float(np.abs(g - e).max())
        logits = "logits" in name
        limit = TOL if logits else TOL * max(1.0, float(np.abs(e).max()))
        if d > limit:
            raise AssertionError(f"{what}: output {name} differs from PyTorch by {d:.2e} > {limit:.1e}")
        if logits:
            worst = max(worst, d)
            if not np.array_equal(g.argmax(-1), e.argmax(-1)):
                raise AssertionError(f"{what}: argmax of {name} differs from PyTorch")
    return worst


def polygraphy_check(
    onnx_path: Path, feed: dict, expected: list[np.ndarray], names: list[str], ref_dir: Path
) -> None:
    """Save PyTorch reference inputs/outputs in polygraphy's format and run
    `polygraphy run --onnxrt --load-inputs --load-outputs` on the graph."""
    from polygraphy.comparator import RunResults
    from polygraphy.comparator.struct import IterationResult
    from polygraphy.json import save_json

    ref_dir.mkdir(parents=True, exist_ok=True)
    stem = Path(onnx_path).name.removesuffix(".onnx")
    pin, pout = ref_dir / f"{stem}.inputs.json", ref_dir / f"{stem}.outputs.json"
    save_json([feed], str(pin))
    results = RunResults()
    results.append(("pytorch", [IterationResult(outputs=dict(zip(names, expected)), runner_name="pytorch")]))
    results.save(str(pout))
    exe = Path(sys.executable).parent / "polygraphy"
    cmd = [str(exe if exe.exists() else "polygraphy"), "run", str(onnx_path), "--onnxrt"]
    cmd += ["--load-inputs", str(pin), "--load-outputs", str(pout), "--atol", str(TOL), "--rtol", str(TOL)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 or "PASSED" not in r.stdout + r.stderr:
        tail = (r.stdout + r.stderr)[-2000:]
        raise AssertionError(f"polygraphy run --onnxrt failed for {onnx_path.name}:\n{tail}")


def _np(x):
    return x.detach().float().numpy() if x.is_floating_point() else x.detach().numpy()


def _torch_outputs(module, example) -> list[np.ndarray]:
    with torch.no_grad():
        out = module(*example)
    return [_np(t) for t in out]


# -- TensorRT ------------------------------------------------------------------------------


def tensorrt_status() -> tuple[bool, str]:
    """(can build, why not)."""
    from dspark.engines.runtimes import RuntimeUnavailable, require_cuda
    from dspark.engines.tensorrt import require_tensorrt

    try:
        require_tensorrt()
        require_cuda("cuda")
    except RuntimeUnavailable as e:
        return False, str(e)
    return True, ""


def check_declared_shapes(
    io: dict, feed: dict, expected: list[np.ndarray], names: list[str], what: str
) -> None:
    """The graph's declared output shapes (symbolic dims bound by the inputs) are the real
    ones: what lets a runtime preallocate every output on the device."""
    dims: dict = {}
    for n, x in feed.items():
        for d, s in zip(io["inputs"][n]["shape"], x.shape):
            if isinstance(d, str):
                dims[d] = s
    for name, e in zip(names, expected):
        declared = [dims.get(d, d) if isinstance(d, str) else d for d in io["outputs"][name]["shape"]]
        if declared != list(e.shape):
            raise AssertionError(
                f"{what}: output {name} is declared {declared} but has shape {list(e.shape)}"
            )


# -- building -----------------------------------------------------------------------------


class Builder:
    """Builds engines into `out`, skipping those whose key (sources + settings) is unchanged."""

    def __init__(self, out: Path, cfg: BuildConfig, log=print) -> None:
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.cfg = cfg
        self.log = log
        self.manifest_path = self.out / "manifest.json"
        old = json.loads(self.manifest_path.read_text()) if self.manifest_path.exists() else {}
        self.old_manifest = old
        self.old = {e["file"]: e for e in old.get("engines", [])}
        self.engines: list[dict] = []
        self.code = code_hash()
        # file → (PyTorch module, example inputs, (input names, output names)): what the GPU gates
        # (engines/parity.py) compare the TensorRT plans against
        self.sources: dict[str, tuple] = {}
        self.tensorrt: dict | None = None  # set by engines/tensorrt.py when plans were built

    def engine(
        self,
        role: str,
        file: str,
        module,
        export_fn,
        examples: list[tuple],
        names,
        source: str,
        shape: dict,
        poly=True,
    ):
        """Export `module` with export_fn(path), optimize, verify on `examples` (the first is
        also the polygraphy reference unless poly=False), and record it. `source` = hash of the
        source weights."""
        path, opt = self.out / file, self.out / file.replace(".onnx", ".opt.onnx")
        key = hashlib.sha256(json.dumps([source, self.code, shape, self.cfg.to_dict()]).encode()).hexdigest()[
            :16
        ]
        self.sources[file] = (module, examples, names)
        prev = self.old.get(file)
        if prev and prev.get("key") == key and path.exists() and opt.exists():
            self.log(f"[engines] {file}: up to date")
            self.engines.append(prev)
            return prev
        t0 = time.time()
        self.log(f"[engines] {file}: exporting ({role})")
        export_fn(path)
        import onnx

        onnx.checker.check_model(str(path))
        sess = session(path, self.cfg.threads, optimized=opt)
        entry = {
            "role": role,
            "backend": "onnxruntime",
            "device": "cpu",
            "file": file,
            "optimized_file": opt.name,
            "shape": shape,
            "io": io_spec(path),
            "source_sha256": source,
            "onnx_sha256": sha256_file(path),
            "optimized_sha256": sha256_file(opt),
            "key": key,
            "ort_session": {"intra_op_threads": self.cfg.threads, "inter_op_threads": 1, "level": "extended"},
        }
        if self.cfg.verify:
            worst = 0.0
            for i, ex in enumerate(examples):
                feed = {n: _np(x) for n, x in zip(names[0], ex)}
                expected = _torch_outputs(module, ex)
                check_declared_shapes(entry["io"], feed, expected, names[1], f"{file} (case {i})")
                worst = max(worst, compare(sess, feed, expected, names[1], f"{file} (case {i})"))
            entry["verified"] = {"cases": len(examples), "max_abs_diff_vs_pytorch": worst}
            if poly:
                feed = {n: _np(x) for n, x in zip(names[0], examples[0])}
                polygraphy_check(
                    path, feed, _torch_outputs(module, examples[0]), names[1], self.out / "reference"
                )
                entry["verified"]["polygraphy"] = "PASSED"
            else:
                entry["verified"]["polygraphy"] = "run on the smallest bucket of this role"
        entry["build_seconds"] = round(time.time() - t0, 2)
        entry["built_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.log(
            f"[engines] {file}: built in {entry['build_seconds']} s"
            + (
                f", max |Δ| vs PyTorch {entry['verified']['max_abs_diff_vs_pytorch']:.1e}"
                if self.cfg.verify
                else ""
            )
        )
        self.engines.append(entry)
        return entry

    def write_manifest(self, extra: dict) -> Path:
        ok, why = tensorrt_status()
        if self.tensorrt is None:  # a cpu build keeps the plans still built from today's ONNX graphs
            onnx = {e["file"]: e.get("onnx_sha256") for e in self.engines}
            kept = [
                e
                for e in self.old.values()
                if e.get("backend") == "tensorrt" and onnx.get(e.get("onnx")) == e.get("onnx_sha256")
            ]
            self.engines += kept
            if kept and self.old_manifest.get("tensorrt", {}).get("built"):
                self.tensorrt = self.old_manifest["tensorrt"]
        manifest = {
            "format": 1,
            "settings": self.cfg.to_dict(),
            "tools": tool_versions(),
            "machine": {"platform": platform.platform(), "processor": platform.machine()},
            "tensorrt": self.tensorrt
            or ({"built": False, "reason": why} if not ok else {"built": False, "reason": "not requested"}),
            "engines": self.engines,
            **extra,
        }
        self.manifest_path.write_text(json.dumps(manifest, indent=2))
        return self.manifest_path


def build_target(b: Builder, model, source: str) -> dict:
    from dspark.export import target as ex

    if next(model.parameters()).dtype != torch.float32:
        model = copy.deepcopy(model).float()
    model = model.eval()
    L = model.cfg.num_layers
    meta = {"config": model.cfg.to_dict(), "rope_positions": ROPE_TABLE_POSITIONS}
    (b.out / "target_meta.json").write_text(json.dumps(meta, indent=2))
    graph = ex.TargetStepGraph(model)
    cases = [ex.example_inputs(model, rows=3, new=5, past=7), ex.example_inputs(model, rows=1, new=4, past=0)]
    return b.engine(
        "target",
        "target.onnx",
        graph,
        lambda p: ex.export_target(model, p),
        cases,
        (ex.input_names(L), ex.output_names(L)),
        source,
        {"rows": "dynamic", "new_tokens": "dynamic", "past": "dynamic"},
    )


def build_drafter(b: Builder, model, source: str, extra_meta: dict) -> Path:
    """All drafter graphs for the bucket list, plus drafter_meta.json for the runtime."""
    from dspark.export import drafter as ex

    cfg = b.cfg
    m = ex._f32(model)
    names = ex.graph_names(m)
    M = m.cfg.block_size + 1  # a round commits at most the anchor + γ drafts
    files: dict = {"drafter_context": "drafter_context.onnx", "drafter_backbone": {}, "drafter_head": {}}
    g = torch.Generator().manual_seed(1)
    ctx_cases = [(torch.randn(2, 9, m.cfg.feature_size, generator=g), torch.arange(3, 12).repeat(2, 1))]
    b.engine(
        "drafter_context",
        files["drafter_context"],
        ex.ContextGraph(m),
        lambda p: ex.export_context(m, p),
        ctx_cases,
        names["drafter_context"],
        source,
        {"rows": "dynamic", "positions": "dynamic"},
    )
    for B in sorted(cfg.buckets):
        first = B == min(cfg.buckets)
        f = f"drafter_backbone.b{B}.onnx"
        files["drafter_backbone"][B] = f
        cases = [ex.backbone_example(m, B, S, M, seed=s) for s, S in ((1, cfg.max_context), (2, 37))]
        b.engine(
            "drafter_backbone",
            f,
            ex.BackboneGraph(m, M),
            lambda p, B=B: ex.export_backbone(m, p, B, cfg.max_context, M),
            cases,
            names["drafter_backbone"],
            source,
            {
                "batch": B,
                "block": m.cfg.block_size,
                "new_positions": M,
                "context": f"dynamic, padded to {ex.context_buckets(cfg.max_context)}",
            },
            poly=first,
        )
        if m.cfg.head != "none":
            f = f"drafter_head.b{B}.onnx"
            files["drafter_head"][B] = f
            b.engine(
                "drafter_head",
                f,
                ex.HeadGraph(m),
                lambda p, B=B: ex.export_head(m, p, B),
                [ex.head_example(m, B, seed=s) for s in (1, 2)],
                names["drafter_head"],
                source,
                {"batch": B, "head": m.cfg.head},
                poly=first,
            )
    if not files["drafter_head"]:
        del files["drafter_head"]
    meta = {
        "config": m.cfg.to_dict(),
        "draft_vocab": m.draft_vocab.tolist(),
        "target_vocab_size": int(m.embed.shape[0]),
        "max_context": cfg.max_context,
        "new_positions": M,
        "buckets": cfg.buckets,
        "context_buckets": ex.context_buckets(cfg.max_context),
        "rope_positions": ROPE_TABLE_POSITIONS,
        "files": {
            k: (
                {str(bb): ff.replace(".onnx", ".opt.onnx") for bb, ff in v.items()}
                if isinstance(v, dict)
                else v.replace(".onnx", ".opt.onnx")
            )
            for k, v in files.items()
        },
        **extra_meta,
    }
    path = b.out / "drafter_meta.json"
    path.write_text(json.dumps(meta, indent=2))
    return path


def _optimized_names(v):
    if isinstance(v, dict):
        return {str(k): f.replace(".onnx", ".opt.onnx") for k, f in v.items()}
    return v.replace(".onnx", ".opt.onnx")


def build_int8_target(b: Builder) -> dict | None:
    """Optional: ONNX Runtime dynamic int8 quantization of the target step graph.

    This is a *different target*: its greedy output is not the fp32 target's, so speculative
    decoding on it is lossless only with respect to itself. It is built only on request
    (`--int8`) and never served by default; `python -m dspark.perf.int8_target` measures its speed and its
    greedy agreement with the fp32 target."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    src = b.out / "target.onnx"
    dst = b.out / "target.int8.onnx"
    fp32 = next((e for e in b.engines if e["file"] == "target.onnx"), None)
    if fp32 is None:
        raise RuntimeError("build the fp32 target engine first")
    key = hashlib.sha256((fp32["onnx_sha256"] + "int8-dynamic-qint8").encode()).hexdigest()[:16]
    prev = b.old.get(dst.name)
    if prev and prev.get("key") == key and dst.exists():
        b.log(f"[engines] {dst.name}: up to date")
        b.engines.append(prev)
        return prev
    t0 = time.time()
    b.log(f"[engines] {dst.name}: dynamic int8 quantization of target.onnx (a different target!)")
    quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8)
    entry = {
        "role": "target_int8",
        "backend": "onnxruntime",
        "device": "cpu",
        "file": dst.name,
        "optimized_file": dst.name,
        "shape": fp32["shape"],
        "io": io_spec(dst),
        "source_sha256": fp32["onnx_sha256"],
        "onnx_sha256": sha256_file(dst),
        "key": key,
        "different_target": True,
        "note": "not the fp32 target: outputs differ; measure with perf/int8_target.py",
        "build_seconds": round(time.time() - t0, 2),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    b.engines.append(entry)
    return entry


INT8_DRAFTER = "int8: ONNX Runtime dynamic quantization, QInt8 weights of the backbone and head MatMuls"


def build_int8_drafter(b: Builder) -> dict:
    """`dspark engines --drafter-precision int8` (the cpu default): the drafter's backbone and
    head graphs with int8 weights (ONNX Runtime dynamic quantization), and drafter_meta.json
    pointing at them.

    Unlike an int8 *target*, this keeps decoding lossless: the drafter only proposes, the fp32
    target verifies, and the proposal's own distribution q is what verification reads. What
    int8 can change is how often the target accepts (measured with `dspark.perf.skip_sim
    record` on both builds, docs/results.md). On this CPU the drafter's MatMuls at a few rows
    are bound by reading their weights, so a quarter of the bytes is most of the gain. The
    context graph stays fp32 (its keys/values are reused for many rounds). CPU builds only:
    the TensorRT plans are built from the fp32 graphs."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    meta_path = b.out / "drafter_meta.json"
    meta = json.loads(meta_path.read_text())
    fp32 = {e["file"]: e for e in b.engines}
    for role in ("drafter_backbone", "drafter_head"):
        for bucket, opt_name in list(meta["files"].get(role, {}).items()):
            src_name = opt_name.replace(".opt.onnx", ".onnx")
            src, dst = b.out / src_name, b.out / src_name.replace(".onnx", ".int8.onnx")
            opt = b.out / dst.name.replace(".onnx", ".opt.onnx")
            base = fp32.get(src_name)
            if base is None:
                raise RuntimeError(f"build the fp32 drafter engines first ({src_name} is not in this build)")
            key = hashlib.sha256((base["onnx_sha256"] + "int8-dynamic-qint8-v1").encode()).hexdigest()[:16]
            meta["files"][role][bucket] = opt.name
            prev = b.old.get(dst.name)
            if prev and prev.get("key") == key and dst.exists() and opt.exists():
                b.log(f"[engines] {dst.name}: up to date")
                b.engines.append(prev)
                continue
            t0 = time.time()
            b.log(f"[engines] {dst.name}: int8 weights of {src_name}")
            quiet = logging.getLogger().level
            logging.getLogger().setLevel(logging.ERROR)  # its advice to pre-process is for CNNs
            try:
                quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8)
            finally:
                logging.getLogger().setLevel(quiet)
            session(dst, b.cfg.threads, optimized=opt)
            b.engines.append(
                {
                    "role": f"{role}_int8",
                    "backend": "onnxruntime",
                    "device": "cpu",
                    "file": dst.name,
                    "optimized_file": opt.name,
                    "shape": base["shape"],
                    "io": io_spec(dst),
                    "source_sha256": base["onnx_sha256"],
                    "onnx_sha256": sha256_file(dst),
                    "optimized_sha256": sha256_file(opt),
                    "key": key,
                    "precision": INT8_DRAFTER,
                    "build_seconds": round(time.time() - t0, 2),
                    "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                }
            )
    meta["drafter_precision"] = INT8_DRAFTER
    meta_path.write_text(json.dumps(meta, indent=2))
    return meta
