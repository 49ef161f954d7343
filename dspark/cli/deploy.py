"""`dspark deploy`: render (and validate) the Kubernetes / KServe manifests for a profile."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(sub) -> None:
    d = sub.add_parser("deploy", help="render Kubernetes + KServe manifests (Deployment, Service, HPA, ...)")
    d.add_argument("--profile", default="cpu", choices=["cpu", "gpu"])
    d.add_argument("--out", default=None, help="folder for the YAML files (default build/deploy/PROFILE)")
    d.add_argument("--name", default="dspark")
    d.add_argument("--namespace", default=None)
    d.add_argument(
        "--image", default=None, help="the serving image (default dspark-triton:PROFILE; see README)"
    )
    d.add_argument("--replicas", type=int, default=2)
    d.add_argument("--min-replicas", type=int, default=1)
    d.add_argument("--max-replicas", type=int, default=8)
    d.add_argument("--data-pvc", default="dspark-data", help="PVC holding engines/, target/ and sps.json")
    d.add_argument("--slots", type=int, default=16)
    d.add_argument("--max-len", type=int, default=2048)
    d.add_argument("--max-queue", type=int, default=64)
    d.add_argument(
        "--drain-seconds", type=int, default=120, help="SIGTERM: how long running streams may finish"
    )
    d.add_argument("--shm-size", default=None, help="/dev/shm size (default 1Gi cpu, 8Gi gpu)")
    d.add_argument("--no-validate", action="store_true", help="skip the offline schema validation")
    d.set_defaults(fn=deploy)


def deploy(args: argparse.Namespace) -> int:
    from dspark.deploy.manifests import DeployConfig, render_manifests, write_manifests
    from dspark.deploy.validate import ManifestError, validate_manifest

    try:
        cfg = DeployConfig(
            profile=args.profile,
            name=args.name,
            namespace=args.namespace,
            image=args.image,
            replicas=args.replicas,
            min_replicas=args.min_replicas,
            max_replicas=args.max_replicas,
            data_pvc=args.data_pvc,
            slots=args.slots,
            max_len=args.max_len,
            max_queue=args.max_queue,
            drain_seconds=args.drain_seconds,
            shm_size=args.shm_size,
        )
        docs = render_manifests(cfg)
        checked = {} if args.no_validate else {s: validate_manifest(d) for s, d in docs.items()}
    except (ValueError, ManifestError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out or f"build/deploy/{args.profile}")
    for path in write_manifests(docs, out):
        stem = path.stem
        print(f"[deploy] {path}" + (f"  (valid: {checked[stem]})" if stem in checked else ""))
    print(f"[deploy] kubectl apply -f {out}/kubernetes.yaml   # or, with KServe: {out}/inferenceservice.yaml")
    return 0
