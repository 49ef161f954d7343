"""TensorRT plans from the same ONNX graphs (`make engines PROFILE=gpu`), and the plan runtime.

Import-guarded: nothing here imports `tensorrt` at module level. Asking for a plan build or a
plan runtime where the package (or a GPU) is missing raises RuntimeUnavailable; a plan built by
another TensorRT version is refused with PlanVersionError (a plan loads only with the version
that built it).

Plans (one per ONNX engine, per precision) sit next to the ONNX files:

  target.fp32.plan              two optimization profiles: decode (rows ≤ max_rows, ≤ decode_tokens
                                new tokens) and prefill (rows ≤ prefill_rows, ≤ prefill_tokens)
  drafter_context.fp32.plan     one profile (rows, positions ≤ max_context)
  drafter_backbone.b{B}.*.plan  one profile per context bucket (the graph's only dynamic axis)
  drafter_head.b{B}.*.plan      static shapes, no profile
  timing.cache                  TensorRT's timing cache, reused by every rebuild

Every input has at least one element in every profile: the runners never send an empty tensor
(a prefill passes one masked past position, see engines/ort.py). TF32 is off in every build
(parity with the fp32 PyTorch oracle); fp16 plans set BuilderFlag.FP16 (TensorRT 10 API;
TensorRT 11 removed it: requirements-gpu.txt pins 10.x).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dspark.engines.runtimes import (
    SETUP_HINT,
    Graph,
    RuntimeUnavailable,
    as_tensor,
    parse_device,
    require_cuda,
)

TIMING_CACHE = "timing.cache"


class PlanVersionError(RuntimeError):
    """A plan built by another TensorRT version (or on another GPU) than this process has."""


def tensorrt_version() -> str | None:
    try:
        import tensorrt
    except ImportError:
        return None
    return tensorrt.__version__


def require_tensorrt():
    """The tensorrt module, or RuntimeUnavailable saying what to install."""
    try:
        import tensorrt
    except ImportError:
        raise RuntimeUnavailable(f"the tensorrt Python package is not installed: {SETUP_HINT}") from None
    major = int(tensorrt.__version__.split(".")[0])
    if major != 10:
        raise RuntimeUnavailable(
            f"TensorRT {tensorrt.__version__} is installed; this project builds with the TensorRT 10 API "
            "(TensorRT 11 removed BuilderFlag.FP16): install the version pinned in requirements-gpu.txt"
        )
    return tensorrt


def plan_file(onnx_name: str, precision: str) -> str:
    """target.onnx → target.fp32.plan (also from the .opt.onnx name)."""
    stem = Path(onnx_name).name.removesuffix(".onnx").removesuffix(".opt")
    return f"{stem}.{precision}.plan"


def gpu_info(device: str | torch.device = "cuda:0") -> dict:
    d = require_cuda(device)
    p = torch.cuda.get_device_properties(d)
    info = {
        "name": p.name,
        "compute_capability": f"{p.major}.{p.minor}",
        "memory_gib": round(p.total_memory / 2**30, 1),
        "cuda_runtime": torch.version.cuda,
    }
    try:
        import subprocess

        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        info["driver"] = r.stdout.strip().splitlines()[d.index or 0] if r.returncode == 0 else None
    except (OSError, IndexError, subprocess.SubprocessError):
        info["driver"] = None
    return info


# -- the manifest's word on a plan ---------------------------------------------------------


def check_plan_version(entry: dict, installed: str | None) -> None:
    """Refuse a plan whose recorded TensorRT version is not the installed one."""
    built = entry.get("tensorrt_version")
    if installed is None:
        raise RuntimeUnavailable(
            f"{entry.get('file')}: a TensorRT plan (built by TensorRT {built}) needs the tensorrt package, "
            f"which is not installed: {SETUP_HINT}"
        )
    if built != installed:
        raise PlanVersionError(
            f"{entry.get('file')} was built by TensorRT {built} but this process has TensorRT {installed}: "
            "a plan loads only with the version that built it; rebuild it here with "
            "`make engines PROFILE=gpu`"
        )


def plan_entry(build: Path, onnx_name: str, precision: str, installed: str | None = ...) -> dict:
    """The manifest entry of the plan built from `onnx_name` at `precision`, checked: recorded,
    on disk, built by the installed TensorRT version."""
    build = Path(build)
    want = plan_file(onnx_name, precision)
    man_path = build / "manifest.json"
    engines = json.loads(man_path.read_text()).get("engines", []) if man_path.exists() else []
    entry = next((e for e in engines if e.get("backend") == "tensorrt" and e.get("file") == want), None)
    if entry is None:
        raise FileNotFoundError(
            f"{build}: no TensorRT plan {want} in manifest.json: build it with `make engines PROFILE=gpu` "
            f"(precision {precision}) on the GPU machine"
        )
    check_plan_version(entry, tensorrt_version() if installed is ... else installed)
    if not (build / entry["plan"]).exists():
        raise FileNotFoundError(f"{build / entry['plan']} is recorded in manifest.json but missing")
    return entry


# -- optimization profiles ------------------------------------------------------------------


@dataclass
class PlanSettings:
    """What the plans must hold; the runners split or refuse anything larger."""

    max_rows: int = 32  # sequences in one decode step (the server's slots)
    decode_tokens: int = 16  # new tokens per row in a decode/verify step (γ + 1 = 8 fits)
    prefill_rows: int = 4
    prefill_tokens: int = 1024
    max_len: int = 2048  # past positions (target KV slots); the serving --max-len must not exceed it
    max_context: int = 2048  # drafter context positions
    context_buckets: list[int] = field(default_factory=list)
    workspace_gib: float = 8.0

    def to_dict(self) -> dict:
        return asdict(self)


def _profile(inputs: dict, ranges: dict) -> dict:
    """{input: [min, opt, max] shapes} from the graph's io spec and {dim name: (min, opt, max)}."""
    out = {}
    for name, spec in inputs.items():
        shapes = []
        for k in range(3):
            shapes.append([d if isinstance(d, int) else ranges[d][k] for d in spec["shape"]])
        out[name] = shapes
    return out


def plan_profiles(role: str, io: dict, s: PlanSettings) -> list[dict]:
    """The optimization profiles of one engine (io = manifest io spec of its ONNX graph)."""
    inputs = io["inputs"]
    dynamic = {d for spec in inputs.values() for d in spec["shape"] if isinstance(d, str)}
    if not dynamic:
        return []
    if role == "target":
        decode = {"R": (1, max(1, s.max_rows // 2), s.max_rows), "N": (1, 8, s.decode_tokens)}
        prefill = {"R": (1, 1, s.prefill_rows), "N": (1, min(256, s.prefill_tokens), s.prefill_tokens)}
        S = (1, min(512, s.max_len), s.max_len)
        return [_profile(inputs, {**decode, "S": S}), _profile(inputs, {**prefill, "S": S})]
    if role == "drafter_context":
        return [_profile(inputs, {"R": (1, 1, s.max_rows), "T": (1, 64, s.max_context)})]
    if role == "drafter_backbone":
        return [_profile(inputs, {"S": (c, c, c)}) for c in (s.context_buckets or [s.max_context])]
    raise ValueError(f"{role}: dynamic dims {sorted(dynamic)} but no profile rule")


# -- building -------------------------------------------------------------------------------


def build_plan(
    onnx_path: Path, plan_path: Path, profiles: list[dict], precision: str, s: PlanSettings, log=print
):
    """Parse the ONNX graph, build a serialized plan with the timing cache beside it (TF32
    off), write it; returns seconds spent."""
    trt = require_tensorrt()
    t0 = time.time()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT cannot parse {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(s.workspace_gib * 2**30))
    config.clear_flag(trt.BuilderFlag.TF32)
    if precision == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
    for p in profiles:
        prof = builder.create_optimization_profile()
        for name, (lo, opt, hi) in p.items():
            prof.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(prof)
    cache_path = plan_path.parent / TIMING_CACHE
    cache = config.create_timing_cache(cache_path.read_bytes() if cache_path.exists() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"TensorRT failed to build {plan_path.name} (see the log above)")
    plan_path.write_bytes(bytes(serialized))
    cache_path.write_bytes(bytes(config.get_timing_cache().serialize()))
    seconds = time.time() - t0
    log(f"[engines] {plan_path.name}: built in {seconds:.1f} s ({len(profiles)} profiles)")
    return seconds


def plan_key(onnx_sha: str, precision: str, profiles: list, version: str, gpu: str) -> str:
    return hashlib.sha256(json.dumps([onnx_sha, precision, profiles, version, gpu]).encode()).hexdigest()[:16]


def build_plans(b, s: PlanSettings, precisions: list[str], device: str = "cuda:0") -> list[dict]:
    """A plan per ONNX engine of the Builder `b` (engines/build.py) and precision, incremental
    (key: ONNX hash, precision, profiles, TensorRT version, GPU); appended to b.engines."""
    trt = require_tensorrt()
    gpu = gpu_info(device)
    made = []
    for e in [e for e in b.engines if e.get("backend") == "onnxruntime" and not e["role"].endswith("_int8")]:
        profiles = plan_profiles(e["role"], e["io"], s)
        for precision in precisions:
            name = plan_file(e["file"], precision)
            key = plan_key(e["onnx_sha256"], precision, profiles, trt.__version__, gpu["name"])
            prev = b.old.get(name)
            if prev and prev.get("key") == key and (b.out / name).exists():
                b.log(f"[engines] {name}: up to date")
                entry = prev
            else:
                secs = build_plan(b.out / e["file"], b.out / name, profiles, precision, s, b.log)
                entry = {
                    "role": e["role"],
                    "backend": "tensorrt",
                    "device": "cuda",
                    "file": name,
                    "plan": name,
                    "onnx": e["file"],
                    "onnx_sha256": e["onnx_sha256"],
                    "precision": precision,
                    "tf32": False,
                    "profiles": profiles,
                    "settings": s.to_dict(),
                    "shape": e["shape"],
                    "io": e["io"],
                    "tensorrt_version": trt.__version__,
                    "gpu": gpu,
                    "timing_cache": TIMING_CACHE,
                    "key": key,
                    "build_seconds": round(secs, 2),
                    "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                }
            b.engines.append(entry)
            made.append(entry)
    return made


# -- running ------------------------------------------------------------------------------


def _torch_dtype(trt, dt):
    table = {
        trt.DataType.FLOAT: torch.float32,
        trt.DataType.HALF: torch.float16,
        trt.DataType.INT32: torch.int32,
        trt.DataType.INT64: torch.int64,
        trt.DataType.BOOL: torch.bool,
    }
    if dt not in table:
        raise TypeError(f"TensorRT tensor type {dt} is not handled")
    return table[dt]


class TrtGraph(Graph):
    """A plan on one GPU: one execution context that switches optimization profile by the call's
    shapes, inputs and preallocated outputs bound by address, `execute_async_v3` on torch's
    current stream (so the runner's gathers and scatters are ordered with it)."""

    runtime = "tensorrt"

    def __init__(self, plan: Path, device: str | torch.device, entry: dict | None = None) -> None:
        trt = require_tensorrt()
        self.trt = trt
        self.device = require_cuda(parse_device(device))
        self.entry = entry or {}
        with torch.cuda.device(self.device):
            self.engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(
                Path(plan).read_bytes()
            )
            if self.engine is None:
                raise PlanVersionError(f"{plan}: TensorRT could not deserialize it (another version or GPU?)")
            self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        is_in = {n: self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT for n in names}
        self.input_names = [n for n in names if is_in[n]]
        self.output_names = [n for n in names if not is_in[n]]
        self.dtypes = {n: _torch_dtype(trt, self.engine.get_tensor_dtype(n)) for n in names}
        self.profiles = [
            {n: [tuple(x) for x in self.engine.get_tensor_profile_shape(n, p)] for n in self.input_names}
            for p in range(self.engine.num_optimization_profiles)
        ]
        self._profile = 0

    def limits(self) -> list[dict[str, tuple]]:
        """Per profile, per input: (min, max) shapes (what the runner may send)."""
        return [{n: (mm[0], mm[2]) for n, mm in p.items()} for p in self.profiles]

    def _choose(self, shapes: dict) -> int:
        for p, prof in enumerate(self.profiles):
            if all(
                all(lo <= x <= hi for x, lo, hi in zip(shapes[n], prof[n][0], prof[n][2])) for n in shapes
            ):
                return p
        raise ValueError(
            f"no optimization profile of {self.entry.get('file', 'this plan')} holds the shapes {shapes}: "
            f"profiles {self.profiles}"
        )

    def run(self, output_names, feed: dict) -> list[torch.Tensor]:
        stream = torch.cuda.current_stream(self.device)
        tensors = {n: as_tensor(x, self.device, self.dtypes[n]) for n, x in feed.items()}
        missing = [n for n in self.input_names if n not in tensors]
        if missing:
            raise ValueError(f"missing inputs {missing}")
        if self.profiles:
            p = self._choose({n: tuple(t.shape) for n, t in tensors.items()})
            if p != self._profile:
                self.context.set_optimization_profile_async(p, stream.cuda_stream)
                self._profile = p
        for n, t in tensors.items():
            self.context.set_input_shape(n, tuple(t.shape))
            self.context.set_tensor_address(n, t.data_ptr())
        outs = {}
        for n in self.output_names:
            shape = tuple(self.context.get_tensor_shape(n))
            if any(d < 0 for d in shape):
                raise RuntimeError(f"{n}: output shape {shape} unresolved after setting the input shapes")
            outs[n] = torch.empty(shape, dtype=self.dtypes[n], device=self.device)
            self.context.set_tensor_address(n, outs[n].data_ptr())
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError(f"{self.entry.get('file', 'plan')}: execute_async_v3 failed")
        return [outs[n] for n in (output_names or self.output_names)]
