"""Flags every command that starts tritonserver shares (serve, demo, sps, bench, gpu-check):
the profile, each engine model's runtime/device/precision, and an external tritonserver."""

from __future__ import annotations

import argparse


def add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--profile", default="cpu", choices=["cpu", "gpu"], help="cpu: ORT on the CPU; gpu: KIND_GPU"
    )
    p.add_argument(
        "--runtime", default=None, choices=["torch", "ort", "tensorrt"],
        help="the engine models' runtime (default: the profile's: cpu → ort, gpu → tensorrt)",
    )  # fmt: skip
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: the profile's)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "fp16"], help="TensorRT plans to serve")
    p.add_argument(
        "--target-outputs", default="host", choices=["host", "device"],
        help="device: the target's logits stay on the GPU and Triton hands them over (DLPack)",
    )  # fmt: skip
    p.add_argument("--tritonserver", default=None, help="a tritonserver binary (default: the pip wheel's)")
    p.add_argument(
        "--backend-dir", "--backend-directory", dest="backend_directory", default=None,
        help="its backends folder (default with --tritonserver: ../backends beside its bin/)",
    )  # fmt: skip


def server_settings(args: argparse.Namespace) -> dict:
    """Keyword arguments of serving.launcher.serving_session for these flags."""
    return {
        "profile": args.profile,
        "runtime": args.runtime,
        "device": args.device,
        "precision": args.precision,
        "outputs": args.target_outputs,
        "tritonserver": args.tritonserver,
        "backend_dir": args.backend_directory,
    }


def render_settings(args: argparse.Namespace) -> dict:
    """Keyword arguments of model_repository.render.render for these flags."""
    s = server_settings(args)
    return {k: s[k] for k in ("runtime", "device", "precision", "outputs")}
