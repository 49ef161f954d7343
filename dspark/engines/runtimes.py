"""Where and how a graph runs: one runtime per model, on one device.

    runtime  torch     the PyTorch graph modules (dspark.export) on the device: the parity oracle
             ort       ONNX Runtime with the CPU, CUDA or TensorRT execution provider, IOBinding on
                       torch buffers of the device (no copy in or out of the session)
             tensorrt  TensorRT plans built from the same ONNX graphs (dspark.engines.tensorrt)
    device   cpu | cuda | cuda:N

Every runtime is a `Graph`: `run(output_names, feed) -> list[torch.Tensor]` (ONNX Runtime's
signature, so the runners in engines/ort.py drive all three the same way), inputs as numpy
arrays or torch tensors, outputs as torch tensors on the graph's device. The runners keep
their caches in `DeviceKV` slots on that device: a step gathers the batch's past keys/values
and scatters the new ones there, so nothing but token ids, positions and what the caller
asked for crosses to the host.

Asking for something this machine does not have (CUDA without a GPU or without a CUDA build of
torch, the CUDA provider without onnxruntime-gpu, TensorRT without the tensorrt package) raises
`RuntimeUnavailable` naming what is missing; nothing falls back to the CPU path silently.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dspark.models.slots import SlotPool

RUNTIMES = ("torch", "ort", "tensorrt")
ALIASES = {"onnxruntime": "ort", "trt": "tensorrt", "pytorch": "torch"}
PRECISIONS = ("fp32", "fp16")
SETUP_HINT = "install the GPU stack with `make setup GPU=1` (see README, 'GPU')"


class RuntimeUnavailable(RuntimeError):
    """The runtime or device asked for is not available here (never replaced by the CPU path)."""


# -- the choice -----------------------------------------------------------------------------


@dataclass(frozen=True)
class RuntimeSpec:
    """One model's runtime: rendered into the Triton model's parameters by the profile
    (cpu: ort on cpu; gpu: tensorrt on cuda:0) and read back by `from_params`."""

    runtime: str = "ort"
    device: str = "cpu"
    providers: tuple[str, ...] = ()  # ORT execution providers, in order; () = the device's default
    precision: str = "fp32"  # tensorrt plans (fp32 | fp16); the torch and ort runtimes run fp32
    threads: int = 2  # ORT intra-op threads on the CPU
    tf32: bool = False  # TF32 matmuls on the GPU: off for parity, stated for speed runs

    def __post_init__(self) -> None:
        runtime = ALIASES.get(self.runtime, self.runtime)
        object.__setattr__(self, "runtime", runtime)
        if runtime not in RUNTIMES:
            raise ValueError(f"unknown runtime {self.runtime!r}: choose one of {', '.join(RUNTIMES)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}: choose one of {', '.join(PRECISIONS)}")
        parse_device(self.device)
        if runtime == "tensorrt" and parse_device(self.device).type != "cuda":
            raise ValueError("runtime tensorrt runs on a GPU: give device cuda or cuda:N")
        if isinstance(self.providers, str):
            object.__setattr__(self, "providers", tuple(p for p in self.providers.split(",") if p))

    @classmethod
    def from_params(cls, params: dict) -> RuntimeSpec:
        """From a Triton model's string parameters (runtime, device, providers, precision,
        threads, tf32); `device_id` (the instance's GPU under KIND_GPU) completes `cuda`."""
        device = params.get("device", "cpu") or "cpu"
        if device == "cuda" and params.get("device_id") not in (None, ""):
            device = f"cuda:{int(params['device_id'])}"
        return cls(
            runtime=params.get("runtime", "ort") or "ort",
            device=device,
            providers=tuple(p for p in params.get("providers", "").split(",") if p),
            precision=params.get("precision", "fp32") or "fp32",
            threads=int(params.get("threads", 2)),
            tf32=params.get("tf32", "0") in ("1", "true", "yes"),
        )

    @property
    def torch_device(self) -> torch.device:
        return parse_device(self.device)

    def ort_providers(self) -> list:
        """ONNX Runtime providers with their options (the CUDA/TensorRT ones on this device)."""
        dev = self.torch_device
        names = list(self.providers) or (
            ["CPUExecutionProvider"]
            if dev.type == "cpu"
            else ["CUDAExecutionProvider", "CPUExecutionProvider"]
        )
        out: list = []
        for name in names:
            if name == "CUDAExecutionProvider":
                opts = {"device_id": str(dev.index or 0), "use_tf32": "1" if self.tf32 else "0"}
                out.append((name, opts))
            elif name == "TensorrtExecutionProvider":
                out.append((name, {"device_id": str(dev.index or 0), "trt_fp16_enable": "0"}))
            else:
                out.append(name)
        return out

    def check(self) -> None:
        """Raise RuntimeUnavailable if this machine cannot run this spec."""
        dev = self.torch_device
        if dev.type == "cuda":
            require_cuda(dev)
        if self.runtime == "tensorrt":
            from dspark.engines.tensorrt import require_tensorrt

            require_tensorrt()
        if self.runtime == "ort":
            import onnxruntime as ort

            have = ort.get_available_providers()
            wanted = [p if isinstance(p, str) else p[0] for p in self.ort_providers()]
            missing = [p for p in wanted if p not in have]
            if missing:
                raise RuntimeUnavailable(
                    f"ONNX Runtime {ort.__version__} here has the providers {have}, not {missing}: "
                    + (SETUP_HINT if dev.type == "cuda" else "choose another provider")
                )
            if dev.type == "cuda" and wanted[0] == "CPUExecutionProvider":
                raise RuntimeUnavailable(
                    f"device {self.device} with only the CPU provider: give a GPU provider"
                )

    def to_dict(self) -> dict:
        return {
            "runtime": self.runtime,
            "device": self.device,
            "providers": list(self.providers),
            "precision": self.precision,
            "tf32": self.tf32,
        }


def parse_device(device: str | torch.device) -> torch.device:
    d = torch.device(device)
    if d.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: use cpu, cuda or cuda:N")
    return d


def require_cuda(device: str | torch.device = "cuda") -> torch.device:
    """The CUDA device, or RuntimeUnavailable saying why it cannot be used."""
    d = parse_device(device)
    if torch.version.cuda is None:
        raise RuntimeUnavailable(
            f"device {d} asked for, but this torch {torch.__version__} is a CPU-only build: {SETUP_HINT}"
        )
    if not torch.cuda.is_available():
        raise RuntimeUnavailable(
            f"device {d} asked for, but no NVIDIA GPU is visible (driver, CUDA_VISIBLE_DEVICES)"
        )
    if (d.index or 0) >= torch.cuda.device_count():
        raise RuntimeUnavailable(
            f"device {d} asked for, but only {torch.cuda.device_count()} GPU(s) are visible"
        )
    return d


def set_tf32(enabled: bool) -> None:
    """TF32 matmuls in PyTorch on the GPU (on by default in cuDNN; off for parity runs)."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


# -- tensors ------------------------------------------------------------------------------


_NP_TO_TORCH = {
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float16): torch.float16,
    np.dtype(np.float64): torch.float64,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.bool_): torch.bool,
}
_ORT_TYPES = {
    "tensor(float)": (np.float32, torch.float32),
    "tensor(float16)": (np.float16, torch.float16),
    "tensor(double)": (np.float64, torch.float64),
    "tensor(int64)": (np.int64, torch.int64),
    "tensor(int32)": (np.int32, torch.int32),
    "tensor(bool)": (np.bool_, torch.bool),
}


def as_tensor(x, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x (numpy array or tensor) as a contiguous tensor on `device` (no copy when it already is)."""
    t = torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else torch.as_tensor(x)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    return t.to(device).contiguous()


def host(x) -> torch.Tensor:
    """A runner's output as a CPU tensor (numpy arrays from a plain ORT session too)."""
    return torch.from_numpy(x) if isinstance(x, np.ndarray) else x.cpu()


# -- device-resident slots -------------------------------------------------------------------


class DeviceKV(SlotPool):
    """Preallocated per-sequence keys/values on a device: per layer [slots, KV, max_len, D]
    tensors; the lengths (bookkeeping) stay on the host. `gather` copies a batch's past into
    contiguous [R, KV, S, D] inputs and `write` scatters new positions in, one indexed copy per
    layer and tensor, on the device."""

    def __init__(
        self,
        layers: int,
        num_slots: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        what: str,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(num_slots, max_len, np.zeros(num_slots, np.int64), what)
        self.device = parse_device(device)
        shape = (num_slots, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(layers)]

    def gather(self, idx, S: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer the first S positions of slots idx: ([R, KV, S, D] keys, values)."""
        i = torch.as_tensor(np.asarray(idx, np.int64)).to(self.device)
        return (
            [k[:, :, :S].index_select(0, i) for k in self.k],
            [v[:, :, :S].index_select(0, i) for v in self.v],
        )

    def write(self, slots, start, new_k, new_v, count, packed: bool = False) -> None:
        """Row r's first count[r] new positions go to slot slots[r] from position start[r]
        (new_k/new_v: per layer [R, KV, N, D], tensors on any device or numpy arrays). `packed`:
        new_k/new_v are [1, KV, sum(count), D], the rows' positions one after another."""
        count = np.asarray(count, np.int64)
        if not count.size or not count.any():
            return
        rows = np.repeat(np.arange(len(count)), count)
        cols = np.concatenate([np.arange(n) for n in count])
        src_r, src_c = (np.zeros_like(rows), np.arange(len(rows))) if packed else (rows, cols)
        dest = np.asarray(slots, np.int64)[rows]
        pos = np.asarray(start, np.int64)[rows] + cols
        r, c, d, p = (torch.from_numpy(a).to(self.device) for a in (src_r, src_c, dest, pos))
        for layer in range(len(self.k)):
            self.k[layer][d, :, p] = as_tensor(new_k[layer], self.device, self.k[layer].dtype)[r, :, c]
            self.v[layer][d, :, p] = as_tensor(new_v[layer], self.device, self.v[layer].dtype)[r, :, c]


# -- graphs -------------------------------------------------------------------------------


class Graph:
    """A runnable graph: run(output_names or None, feed) -> outputs (torch, on `device`)."""

    device: torch.device
    input_names: list[str]
    output_names: list[str]
    runtime: str = ""

    def run(self, output_names, feed: dict) -> list[torch.Tensor]:
        raise NotImplementedError


def _resolve(spec, dims: dict) -> list[int] | None:
    shape = []
    for d in spec:
        if isinstance(d, int):
            shape.append(d)
        elif isinstance(d, str) and d in dims:
            shape.append(dims[d])
        else:
            return None
    return shape


class OrtGraph(Graph):
    """An ONNX Runtime session run through IOBinding on torch buffers of its device: inputs are
    bound where they are, outputs are preallocated tensors whose shapes come from the graph's
    symbolic dims (the exporter pins every other dim), so nothing is copied in or out."""

    runtime = "ort"

    def __init__(self, sess, device: str | torch.device = "cpu") -> None:
        self.sess = sess
        self.device = parse_device(device)
        self._in = {i.name: (i.shape, _ORT_TYPES[i.type]) for i in sess.get_inputs()}
        self._out = {o.name: (o.shape, _ORT_TYPES[o.type]) for o in sess.get_outputs()}
        self.input_names = list(self._in)
        self.output_names = list(self._out)

    def run(self, output_names, feed: dict) -> list[torch.Tensor]:
        dev, dev_id = self.device.type, self.device.index or 0
        io = self.sess.io_binding()
        dims: dict[str, int] = {}
        keep = []
        for name, x in feed.items():
            spec, (np_t, torch_t) = self._in[name]
            t = as_tensor(x, self.device, torch_t)
            if t.numel() == 0:  # an empty tensor has no buffer to bind: let ORT own a copy
                io.bind_ortvalue_input(name, _ortvalue(np.zeros(tuple(t.shape), np_t), dev, dev_id))
            else:
                io.bind_input(name, dev, dev_id, np_t, list(t.shape), t.data_ptr())
            keep.append(t)
            for d, s in zip(spec, t.shape):
                if isinstance(d, str):
                    if dims.setdefault(d, s) != s:
                        raise ValueError(f"{name}: dim {d} is {s} here but {dims[d]} in another input")
        names = list(output_names or self.output_names)
        outs: list = []
        for name in names:
            spec, (np_t, torch_t) = self._out[name]
            shape = _resolve(spec, dims)
            if shape is None or 0 in shape:
                io.bind_output(name, dev, dev_id)  # ORT allocates it; copied below (slow path)
                outs.append(None)
                continue
            t = torch.empty(shape, dtype=torch_t, device=self.device)
            io.bind_output(name, dev, dev_id, np_t, shape, t.data_ptr())
            outs.append(t)
        if dev == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # inputs written by torch are ready
        self.sess.run_with_iobinding(io)
        if dev == "cuda":
            io.synchronize_outputs()
        if any(o is None for o in outs):
            got = io.get_outputs()
            outs = [as_tensor(got[i].numpy(), self.device) if o is None else o for i, o in enumerate(outs)]
        return outs


def _ortvalue(a: np.ndarray, dev: str, dev_id: int):
    import onnxruntime as ort

    return ort.OrtValue.ortvalue_from_numpy(a, dev, dev_id)


class TorchGraph(Graph):
    """A graph module of dspark.export (the same code the ONNX graph was traced from) run in
    PyTorch on the device; factory calls inside it default to that device."""

    runtime = "torch"

    def __init__(self, module: torch.nn.Module, input_names, output_names, device="cpu") -> None:
        self.device = parse_device(device)
        self.module = module.to(self.device).eval()
        for sub in self.module.modules():  # plain tensor attributes (a drafter's attached embedding)
            for k, v in list(vars(sub).items()):
                if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter):
                    setattr(sub, k, v.to(self.device))
        self.input_names, self.output_names = list(input_names), list(output_names)

    def run(self, output_names, feed: dict) -> list[torch.Tensor]:
        args = [as_tensor(feed[n], self.device) for n in self.input_names if n in feed]
        with torch.no_grad(), self.device:
            out = dict(zip(self.output_names, self.module(*args)))
        return [out[n] for n in (output_names or self.output_names)]


def as_graph(x, device="cpu") -> Graph:
    """A Graph from a Graph or a plain onnxruntime.InferenceSession (CPU)."""
    return x if isinstance(x, Graph) else OrtGraph(x, device)


def ort_session(path: Path, spec: RuntimeSpec, optimized: Path | None = None):
    """An ONNX Runtime session for `spec` (threads, providers); refuses a session whose first
    provider is not the one asked for (ORT falls back to the CPU provider silently when the
    CUDA libraries fail to load)."""
    import onnxruntime as ort

    spec.check()
    so = ort.SessionOptions()
    so.intra_op_num_threads = spec.threads
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    # ORT's pool threads spin after every run by default; on 2 cores that steals the CPU from the
    # Python/torch work between engine calls (sampling, the next call's inputs): 3x slower rounds.
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if optimized is not None:
        so.optimized_model_filepath = str(optimized)
    providers = spec.ort_providers()
    if spec.torch_device.type == "cuda" and hasattr(ort, "preload_dlls"):
        ort.preload_dlls()  # CUDA/cuDNN of the nvidia-*-cu12 wheels (torch's may be another CUDA major)
    sess = ort.InferenceSession(str(path), so, providers=providers)
    first = providers[0] if isinstance(providers[0], str) else providers[0][0]
    if sess.get_providers()[0] != first:
        raise RuntimeUnavailable(
            f"{Path(path).name}: ONNX Runtime did not enable {first} (active: {sess.get_providers()}); "
            f"see its log for the missing library: {SETUP_HINT}"
        )
    return sess


# -- a build's graphs for one runtime ------------------------------------------------------


def onnx_file(build: Path, file: str, spec: RuntimeSpec) -> Path:
    """The ONNX file a runtime loads for an engine: the ORT-optimized graph on the CPU (what
    `make engines` verified and saved), the exported graph for GPU providers (the optimized
    one may hold CPU-only fused operators)."""
    opt = file.replace(".onnx", ".opt.onnx") if not file.endswith(".opt.onnx") else file
    raw = opt.replace(".opt.onnx", ".onnx")
    return Path(build) / (opt if spec.torch_device.type == "cpu" else raw)


def open_graph(build: Path, file: str, spec: RuntimeSpec) -> Graph:
    """The Graph of one engine file (`target.onnx`, `drafter_backbone.b8.opt.onnx`, ...) of a
    build for an ort or tensorrt spec (the torch runtime has no files: torch_*_graph)."""
    build = Path(build)
    if spec.runtime == "torch":
        raise ValueError("the torch runtime runs the PyTorch modules: use target_graph / drafter_graphs")
    if spec.runtime == "tensorrt":
        from dspark.engines.tensorrt import TrtGraph, plan_entry

        entry = plan_entry(build, file, spec.precision)
        return TrtGraph(build / entry["plan"], spec.device, entry)
    path = onnx_file(build, file, spec)
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `make engines`")
    return OrtGraph(ort_session(path, spec), spec.device)


def build_meta(build: Path) -> tuple[dict, dict | None]:
    """(target_meta.json, drafter_meta.json or None) of a build."""
    build = Path(build)
    target = json.loads((build / "target_meta.json").read_text())
    d = build / "drafter_meta.json"
    return target, (json.loads(d.read_text()) if d.exists() else None)


def required_files(build: Path, spec: RuntimeSpec, service: str, target_dir=None) -> list[Path]:
    """The files a service loads for spec (so a rendered repository can be checked before the
    server starts: a missing one is an error naming it, never a skipped model)."""
    build = Path(build)
    files = [build / "target_meta.json"]
    drafter = build / "drafter_meta.json"
    meta = None
    if service == "target":
        names = ["target.onnx"]
    else:
        files.append(drafter)
        if not drafter.exists():
            return files
        meta = json.loads(drafter.read_text())
        names = ["drafter_context.onnx"] + [
            f.replace(".opt.onnx", ".onnx")
            for role in ("drafter_backbone", "drafter_head")
            for f in meta["files"].get(role, {}).values()
        ]
    if spec.runtime == "ort":
        files += [onnx_file(build, n, spec) for n in names]
    elif spec.runtime == "tensorrt":
        from dspark.engines.tensorrt import plan_file

        files += [build / plan_file(n, spec.precision) for n in names]
    else:  # torch: the checkpoints
        tdir = Path(target_dir) if target_dir else build / "(no target_dir given)"
        files.append(tdir)  # a checkpoint directory (safetensors + dspark_target.json or config.json)
        if meta is not None:
            name = meta.get("drafter") or "(drafter_meta.json names no checkpoint)"
            from dspark.paths import REPO

            d = REPO / "drafters" / name if (REPO / "drafters" / name).is_dir() else Path(name)
            files.append(d / "drafter.json")
    return files


def _torch_target(target_dir):
    """The fp32 PyTorch target for the torch runtime (a checkpoint directory, safetensors)."""
    from dspark.models.loading import load_checkpoint_dir

    if not target_dir:
        raise RuntimeUnavailable("the torch runtime needs the target checkpoint: give target_dir")
    return load_checkpoint_dir(Path(target_dir), torch.float32)


def torch_target_graph(model, device="cpu") -> Graph:
    """The torch runtime's target graph from a PyTorch target (fp32)."""
    from dspark.export import target as ex

    L = model.cfg.num_layers
    return TorchGraph(ex.TargetStepGraph(model.float().eval()), ex.input_names(L), ex.output_names(L), device)


def torch_drafter_graphs(model, meta: dict, device="cpu") -> dict:
    """The torch runtime's drafter graphs (one module for every bucket) from a PyTorch drafter
    with its target parts attached (fp32)."""
    from dspark.export import drafter as ex

    names = ex.graph_names(model)
    make = {
        "drafter_context": lambda: ex.ContextGraph(model),
        "drafter_backbone": lambda: ex.BackboneGraph(model, meta["new_positions"]),
        "drafter_head": lambda: ex.HeadGraph(model),
    }
    out: dict = {"drafter_context": TorchGraph(make["drafter_context"](), *names["drafter_context"], device)}
    for role in ("drafter_backbone", "drafter_head"):
        files = meta["files"].get(role, {})
        if files:
            g = TorchGraph(make[role](), *names[role], device)
            out[role] = {int(b): g for b in files}
    return out


def target_graph(build: Path, spec: RuntimeSpec, target_dir=None) -> Graph:
    """The target step graph of a build on spec's runtime and device (the torch runtime loads
    the checkpoint in target_dir)."""
    if spec.runtime == "torch":
        if spec.torch_device.type == "cuda":
            require_cuda(spec.torch_device)
        return torch_target_graph(_torch_target(target_dir), spec.device)
    return open_graph(build, "target.onnx", spec)


def drafter_graphs(build: Path, meta: dict, spec: RuntimeSpec, target_dir=None) -> dict:
    """{drafter_context: Graph, drafter_backbone: {B: Graph}, drafter_head: {B: Graph}} of a
    build on spec's runtime and device."""
    if spec.runtime == "torch":
        if spec.torch_device.type == "cuda":
            require_cuda(spec.torch_device)
        return torch_drafter_graphs(_torch_drafter(meta, target_dir), meta, spec.device)
    out: dict = {"drafter_context": open_graph(build, meta["files"]["drafter_context"], spec)}
    for role in ("drafter_backbone", "drafter_head"):
        files = meta["files"].get(role, {})
        out[role] = {int(b): open_graph(build, f, spec) for b, f in files.items()}
    return out


def _torch_drafter(meta: dict, target_dir):
    from dspark.models.block_drafter import BlockDrafter
    from dspark.paths import REPO

    name = meta.get("drafter")
    if not name:
        raise RuntimeUnavailable(
            "drafter_meta.json does not name its checkpoint: the torch runtime cannot load it"
        )
    path = REPO / "drafters" / name if (REPO / "drafters" / name).is_dir() else Path(name)
    target = _torch_target(target_dir)
    m = BlockDrafter.load(path).float().eval()  # fp32, as exported
    return m.attach(target.model.embed_tokens.weight.float(), target.lm_head.weight.float())
