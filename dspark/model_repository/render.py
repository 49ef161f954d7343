"""Render the Triton model repository for a profile, and validate it without a server.

    render(profile, out, engines_dir, target_dir, ...) -> out/{target,drafter_backbone,drafter_head,dspark}

Templates live in dspark/model_repository/templates: `<model>/config.pbtxt` (or `config.<profile>.pbtxt`
where a profile differs), `${name}` placeholders filled from the engine build and the serving
settings; a placeholder left unfilled fails the render. `validate` parses every config.pbtxt
against Triton's model_config proto (from tritonclient) and checks what the server would:
name = folder, backend/platform pairs, the model file, decoupled for the orchestrator.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from string import Template

from dspark.paths import REPO

TEMPLATES = Path(__file__).resolve().parent / "templates"
PROFILES = {"cpu": "onnxruntime", "gpu": "tensorrt"}


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
    default_mode: str = "dspark",
    sps_path: str = "",
    max_queue: int = 64,
    drafter_retry_s: float = 10.0,
    prefill_budget: int = 2048,
    max_prompt_tokens: int = 0,
    max_stop_strings: int = 8,
    max_stop_chars: int = 128,
    max_request_bytes: int = 1 << 20,
) -> list[str]:
    """Write the repository; returns the model names (load them all)."""
    if profile not in PROFILES:
        raise RenderError(f"unknown profile {profile!r}: choose one of {sorted(PROFILES)}")
    engines_dir, out = Path(engines_dir).resolve(), Path(out)
    values = {
        "code_root": str(REPO),
        "engines_dir": str(engines_dir),
        "target_dir": str(Path(target_dir).resolve()) if target_dir else "",
        "num_slots": str(num_slots),
        "max_len": str(max_len),
        "threads": str(threads),
        "runtime": PROFILES[profile],
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
        if 'backend: "python"' in text:
            code = src / "model.py" if (src / "model.py").exists() else TEMPLATES / "_service_model.py"
            shutil.copy2(code, out / m / "1" / "model.py")
        else:
            plan = engines_dir / f"{m}.plan"
            if plan.exists():
                shutil.copy2(plan, out / m / "1" / plan.name)
    return models


def validate(repo: Path, require_files: bool = True) -> dict:
    """Parse every config.pbtxt against Triton's ModelConfig proto + the server's own rules.
    Returns {model: ModelConfig}; raises RenderError naming the model and the problem."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    configs = {}
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
        elif cfg.platform == "tensorrt_plan":
            if require_files and not (d / "1" / (cfg.default_model_filename or "model.plan")).exists():
                raise RenderError(f"{d.name}: the TensorRT plan is missing (build it on the GPU machine)")
        else:
            raise RenderError(f"{d.name}: unexpected backend {cfg.backend!r} / platform {cfg.platform!r}")
        if d.name == "dspark" and not cfg.model_transaction_policy.decoupled:
            raise RenderError("dspark: the orchestrator must be decoupled (streaming)")
        configs[d.name] = cfg
    if "target" not in configs or "dspark" not in configs:
        raise RenderError(f"{repo}: the repository needs at least the target and dspark models")
    return configs
