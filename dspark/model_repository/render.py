"""Render the Triton model repository for a profile, and validate it without a server.

    render(profile, out, engines_dir, target_dir, ...) -> out/{target,drafter_backbone,drafter_head,dspark}

Templates live in dspark/model_repository/templates: `<model>/config.pbtxt` (or `config.<profile>.pbtxt`
where a profile differs), `${name}` placeholders filled from the engine build and the serving
settings; a placeholder left unfilled fails the render. `validate` parses every config.pbtxt
against Triton's model_config proto (from tritonclient) and checks what the server would:
name = folder, backend/platform pairs, the model file, decoupled for the orchestrator, and every
engine file the model's runtime will load (a missing one is an error naming it).

Profiles (PROFILES): every model is a python-backend model in both, so one repository works on
the pip tritonserver (python backend only) and in NVIDIA's container; the profile picks each
engine model's runtime, device and instance kind:
  cpu  runtime ort (CPU provider), device cpu, KIND_CPU
  gpu  runtime tensorrt (plans from `make engines PROFILE=gpu`), device cuda, KIND_GPU;
       `runtime` may be overridden (ort: the CUDA provider; torch: the PyTorch oracle)
The orchestrator `dspark` stays on the CPU in both.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from string import Template

from dspark.core.scheduler import DEFAULT_MODE
from dspark.paths import REPO

TEMPLATES = Path(__file__).resolve().parent / "templates"
PROFILES = {
    "cpu": {"runtime": "ort", "device": "cpu", "kind": "KIND_CPU"},
    "gpu": {"runtime": "tensorrt", "device": "cuda", "kind": "KIND_GPU"},
}


class RenderError(ValueError):
    pass


def _fill(text: str, values: dict, where: str) -> str:
    try:
        out = Template(text).substitute(values)
    except KeyError as e:
        raise RenderError(f"{where}: no value for placeholder ${{{e.args[0]}}}") from None
    except ValueError as e:
        raise RenderError(f"{where}: malformed placeholder ({e})") from None
    left = re.findall(r"\$\{[^}]*\}", out)
    if left:
        raise RenderError(f"{where}: placeholders left after rendering: {left}")
    return out


def render(
    profile: str,
    out: Path,
    engines_dir: Path,
    target_dir: Path | None,
    num_slots: int = 16,
    max_len: int = 2048,
    threads: int = 2,
    max_active: int | None = None,
    max_new_tokens: int = 1024,
    default_mode: str = DEFAULT_MODE,
    sps_path: str = "",
    max_queue: int = 64,
    drafter_retry_s: float = 10.0,
    prefill_budget: int = 2048,
    max_prompt_tokens: int = 0,
    max_stop_strings: int = 8,
    max_stop_chars: int = 128,
    max_request_bytes: int = 1 << 20,
    runtime: str | None = None,
    device: str | None = None,
    providers: str = "",
    precision: str = "fp32",
    outputs: str = "host",
    tf32: bool = False,
) -> list[str]:
    """Write the repository; returns the model names (load them all). runtime / device default
    to the profile's; outputs="device" leaves the target's logits on the GPU for Triton to
    hand over through DLPack (gpu profile only)."""
    from dspark.engines.runtimes import RuntimeSpec

    if profile not in PROFILES:
        raise RenderError(f"unknown profile {profile!r}: choose one of {sorted(PROFILES)}")
    prof = PROFILES[profile]
    try:
        spec = RuntimeSpec(runtime or prof["runtime"], device or prof["device"], providers, precision)
    except ValueError as e:
        raise RenderError(f"profile {profile}: {e}") from None
    on_gpu = spec.torch_device.type == "cuda"
    if on_gpu != (profile == "gpu"):
        where = "the GPU" if profile == "gpu" else "the CPU"
        raise RenderError(
            f"profile {profile} runs its engine models on {where}: device {spec.device} does not"
        )
    if outputs not in ("host", "device") or (outputs == "device" and not on_gpu):
        raise RenderError("outputs must be host, or device on the gpu profile")
    engines_dir, out = Path(engines_dir).resolve(), Path(out)
    gpus = f" gpus: [ {spec.torch_device.index} ]" if on_gpu and spec.torch_device.index is not None else ""
    values = {
        "code_root": str(REPO),
        "engines_dir": str(engines_dir),
        "target_dir": str(Path(target_dir).resolve()) if target_dir else "",
        "num_slots": str(num_slots),
        "max_len": str(max_len),
        "threads": str(threads),
        "runtime": spec.runtime,
        "device": spec.device,
        "providers": ",".join(spec.providers),
        "precision": spec.precision,
        "outputs": outputs,
        "tf32": "1" if tf32 else "0",
        "instance_group": f"instance_group [ {{ kind: {prof['kind']} count: 1{gpus} }} ]",
        "max_active": str(max_active or num_slots),
        "max_new_tokens": str(max_new_tokens),
        "default_mode": default_mode,
        "sps_path": str(sps_path),
        "max_queue": str(max_queue),
        "drafter_retry_s": str(drafter_retry_s),
        "prefill_budget": str(prefill_budget),
        "max_prompt_tokens": str(max_prompt_tokens),
        "max_stop_strings": str(max_stop_strings),
        "max_stop_chars": str(max_stop_chars),
        "max_request_bytes": str(max_request_bytes),
    }
    models = ["target", "dspark"]
    meta_path = engines_dir / "drafter_meta.json"
    if meta_path.exists():
        c = json.loads(meta_path.read_text())["config"]
        values.update(
            feature_size=str(c["feature_size"]),
            block_size=str(c["block_size"]),
            draft_vocab_size=str(c["draft_vocab_size"]),
            hidden_size=str(c["hidden_size"]),
            markov_rank=str(c.get("markov_rank", 1)),
        )
        models[1:1] = ["drafter_backbone"] + (["drafter_head"] if c["head"] != "none" else [])
    values["common_params"] = _fill(
        (TEMPLATES / "_common_params.pbtxt").read_text(), values, "_common_params"
    )
    if out.exists():
        shutil.rmtree(out)
    for m in models:
        src = TEMPLATES / m
        cfg = src / f"config.{profile}.pbtxt"
        cfg = cfg if cfg.exists() else src / "config.pbtxt"
        text = _fill(cfg.read_text(), values, f"{m}/{cfg.name}")
        (out / m / "1").mkdir(parents=True)
        (out / m / "config.pbtxt").write_text(text)
        if 'backend: "python"' not in text:
            raise RenderError(f"{m}/{cfg.name}: every model of this repository is a python-backend model")
        code = src / "model.py" if (src / "model.py").exists() else TEMPLATES / "_service_model.py"
        shutil.copy2(code, out / m / "1" / "model.py")
    return models


def validate(repo: Path, require_files: bool = True) -> dict:
    """Parse every config.pbtxt against Triton's ModelConfig proto + the server's own rules.
    Returns {model: ModelConfig}; raises RenderError naming the model and the problem."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    configs = {}
    missing: list[str] = []  # every model's missing files, reported together
    for d in sorted(p for p in Path(repo).iterdir() if p.is_dir()):
        path = d / "config.pbtxt"
        if not path.exists():
            raise RenderError(f"{d.name}: no config.pbtxt")
        text = path.read_text()
        if "${" in text:
            raise RenderError(f"{d.name}: template placeholder left in config.pbtxt")
        try:
            cfg = text_format.Parse(text, model_config_pb2.ModelConfig())
        except text_format.ParseError as e:
            raise RenderError(f"{d.name}/config.pbtxt does not parse as a Triton ModelConfig: {e}") from None
        if cfg.name != d.name:
            raise RenderError(f"{d.name}: config name {cfg.name!r} differs from its folder")
        if cfg.backend == "python":
            if cfg.platform:
                raise RenderError(f"{d.name}: a python-backend model must not set platform")
            if require_files and not (d / "1" / "model.py").exists():
                raise RenderError(f"{d.name}: 1/model.py is missing")
            if require_files:
                missing += _missing_engine_files(
                    d.name, {k: v.string_value for k, v in cfg.parameters.items()}
                )
        else:
            raise RenderError(f"{d.name}: unexpected backend {cfg.backend!r} / platform {cfg.platform!r}")
        if d.name == "dspark" and not cfg.model_transaction_policy.decoupled:
            raise RenderError("dspark: the orchestrator must be decoupled (streaming)")
        configs[d.name] = cfg
    if missing:
        raise RenderError("; ".join(missing))
    if "target" not in configs or "dspark" not in configs:
        raise RenderError(f"{repo}: the repository needs at least the target and dspark models")
    return configs


def _missing_engine_files(model: str, params: dict) -> list[str]:
    """[] when every file the model's service will load exists, else one line naming them."""
    from dspark.engines.runtimes import RuntimeSpec, required_files

    if "service" not in params:
        return []
    try:
        spec = RuntimeSpec.from_params(params)
    except ValueError as e:
        raise RenderError(f"{model}: {e}") from None
    files = required_files(
        Path(params["engines_dir"]), spec, params["service"], params.get("target_dir") or None
    )
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        how = (
            "build the plans on the GPU machine: make engines PROFILE=gpu"
            if spec.runtime == "tensorrt"
            else "run `make engines`"
            if spec.runtime == "ort"
            else "give the checkpoint (--target)"
        )
        return [f"{model} (runtime {spec.runtime}) needs files that are missing: {missing}; {how}"]
    return []
