"""`dspark deploy`: a ready-to-apply set of manifests for one profile (cpu | gpu).

    docs = render_manifests(DeployConfig(profile="gpu", replicas=2))
    write_manifests(docs, Path("build/deploy/gpu"))  # one YAML file per object + all.yaml

Objects (plain dicts, validated offline by dspark.deploy.validate):
  Deployment               tritonserver pods: an initContainer renders the model repository from
                           the engines on a PVC (`dspark serve --render-only`) into an emptyDir; the
                           server container serves it (`dspark serve --no-render`, which also
                           supervises the python-backend stubs); probes on /v2/health/{live,ready};
                           /dev/shm as a memory-backed emptyDir; non-root; nvidia.com/gpu for gpu
  Service                  ports http 8000, grpc 8001, metrics 8002
  ServiceMonitor           Prometheus Operator scrape of /metrics keeping dspark_* and nv_* series
  HorizontalPodAutoscaler  autoscaling/v2 on the per-pod dspark_active_sequences and
                           dspark_queued_requests, served through prometheus-adapter
  ConfigMap                the prometheus-adapter rules that expose those two series as pod metrics
  InferenceService         KServe serving.kserve.io/v1beta1, protocol v2, runtime kserve-tritonserver,
                           the same initContainer + server container (alternative to the Deployment)

The cpu/gpu differences are all in PROFILES and `_server_command`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

DATA = "/data"  # the PVC: engines/, target/ (tokenizer + chat template), sps.json
REPOSITORY = "/repository/models"  # the emptyDir the initContainer renders into
NGC_TRITON = "nvcr.io/nvidia/tritonserver:24.10-py3"  # Triton 2.51, the version of the pip wheel


@dataclass(frozen=True)
class Profile:
    image: str
    cpu: str
    memory: str
    shm: str
    gpus: int
    # gpu: the container's own tritonserver (with the TensorRT backend); cpu: the pip wheel's
    tritonserver: str | None
    backend_directory: str | None


PROFILES = {
    "cpu": Profile("dspark-triton:cpu", "2", "8Gi", "1Gi", 0, None, None),
    "gpu": Profile(
        "dspark-triton:gpu",
        "4",
        "32Gi",
        "8Gi",
        1,
        "/opt/tritonserver/bin/tritonserver",
        "/opt/tritonserver/backends",
    ),
}


@dataclass
class DeployConfig:
    profile: str = "cpu"
    name: str = "dspark"
    namespace: str | None = None
    image: str | None = None  # default: PROFILES[profile].image (see README: how to build it)
    replicas: int = 2
    min_replicas: int = 1
    max_replicas: int = 8
    data_pvc: str = "dspark-data"
    slots: int = 16
    max_len: int = 2048
    max_queue: int = 64
    threads: int | None = None
    drain_seconds: int = 120  # SIGTERM: tritonserver waits this long for running streams
    shm_size: str | None = None
    target_active_per_pod: float | None = None  # default: 3/4 of the slots
    target_queued_per_pod: float = 2.0
    scrape_interval: str = "15s"
    labels: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.profile not in PROFILES:
            raise ValueError(f"unknown profile {self.profile!r}: choose one of {sorted(PROFILES)}")
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError("need 1 <= min_replicas <= max_replicas")
        if self.slots < 1 or self.drain_seconds < 1:
            raise ValueError("slots and drain_seconds must be >= 1")

    @property
    def p(self) -> Profile:
        return PROFILES[self.profile]


def _labels(cfg: DeployConfig) -> dict:
    return {
        "app.kubernetes.io/name": "dspark-triton",
        "app.kubernetes.io/instance": cfg.name,
        "app.kubernetes.io/component": "inference-server",
        **cfg.labels,
    }


def _meta(cfg: DeployConfig, name: str, extra_labels: dict | None = None) -> dict:
    meta = {"name": name, "labels": {**_labels(cfg), **(extra_labels or {})}}
    if cfg.namespace:
        meta["namespace"] = cfg.namespace
    return meta


def _serving_flags(cfg: DeployConfig) -> list[str]:
    threads = cfg.threads or int(cfg.p.cpu)
    return [
        f"--profile={cfg.profile}",
        f"--repository={REPOSITORY}",
        f"--slots={cfg.slots}",
        f"--max-len={cfg.max_len}",
        f"--max-queue={cfg.max_queue}",
        f"--threads={threads}",
    ]


def _render_command(cfg: DeployConfig) -> list[str]:
    return [
        "dspark",
        "serve",
        "--render-only",
        f"--engines={DATA}/engines",
        f"--target={DATA}/target",
        f"--sps={DATA}/sps.json",
        *_serving_flags(cfg),
    ]


def _server_command(cfg: DeployConfig) -> list[str]:
    cmd = [
        "dspark",
        "serve",
        "--no-render",
        f"--profile={cfg.profile}",
        f"--repository={REPOSITORY}",
        "--host=0.0.0.0",  # the pod IP: the Service forwards there
        "--allow-remote",
        "--http-port=8000",
        "--grpc-port=8001",
        "--metrics-port=8002",
        f"--exit-timeout={cfg.drain_seconds}",
    ]
    if cfg.p.tritonserver:
        cmd += [f"--tritonserver={cfg.p.tritonserver}", f"--backend-directory={cfg.p.backend_directory}"]
    return cmd


_HARDENED = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": False,  # the python stubs write to /tmp and /dev/shm
    "capabilities": {"drop": ["ALL"]},
}


def _pod_parts(cfg: DeployConfig) -> dict:
    """initContainers, containers, volumes, securityContext, grace period: shared by the
    Deployment and the InferenceService."""
    image = cfg.image or cfg.p.image
    resources = {
        "requests": {"cpu": cfg.p.cpu, "memory": cfg.p.memory},
        "limits": {"memory": cfg.p.memory},
    }
    if cfg.p.gpus:
        resources["limits"]["nvidia.com/gpu"] = cfg.p.gpus
        resources["requests"]["nvidia.com/gpu"] = cfg.p.gpus
    probe = {"httpGet": {"path": "/v2/health/ready", "port": "http"}}
    server = {
        "name": "tritonserver",
        "image": image,
        "command": _server_command(cfg),
        "ports": [
            {"name": "http", "containerPort": 8000, "protocol": "TCP"},
            {"name": "grpc", "containerPort": 8001, "protocol": "TCP"},
            {"name": "metrics", "containerPort": 8002, "protocol": "TCP"},
        ],
        "env": [{"name": "OMP_NUM_THREADS", "value": str(cfg.threads or int(cfg.p.cpu))}],
        # live: the process answers; ready: every model loaded and not shutting down (SIGTERM turns
        # it false first, so the Service stops sending new streams while running ones drain)
        "livenessProbe": {
            "httpGet": {"path": "/v2/health/live", "port": "http"},
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
        "readinessProbe": {**probe, "periodSeconds": 5, "failureThreshold": 2},
        # model loading (engines, SPS probe) may take minutes: liveness waits for this
        "startupProbe": {**probe, "periodSeconds": 5, "failureThreshold": 120},
        "resources": resources,
        "securityContext": _HARDENED,
        "volumeMounts": [
            {"name": "data", "mountPath": DATA, "readOnly": True},
            {"name": "repository", "mountPath": "/repository"},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }
    init = {
        "name": "render-repository",
        "image": image,
        "command": _render_command(cfg),
        "resources": {"requests": {"cpu": "500m", "memory": "2Gi"}, "limits": {"memory": "2Gi"}},
        "securityContext": _HARDENED,
        "volumeMounts": [
            {"name": "data", "mountPath": DATA, "readOnly": True},
            {"name": "repository", "mountPath": "/repository"},
        ],
    }
    return {
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "runAsGroup": 1000,
            "fsGroup": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        # the server's own drain (exit timeout) plus time to stop the stubs
        "terminationGracePeriodSeconds": cfg.drain_seconds + 30,
        "initContainers": [init],
        "containers": [server],
        "volumes": [
            {"name": "data", "persistentVolumeClaim": {"claimName": cfg.data_pvc, "readOnly": True}},
            {"name": "repository", "emptyDir": {"sizeLimit": "64Mi"}},
            # the python backend moves every tensor through /dev/shm (1 MiB per instance, growing)
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": cfg.shm_size or cfg.p.shm}},
        ],
    }


def deployment(cfg: DeployConfig) -> dict:
    pod = _pod_parts(cfg)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(cfg, cfg.name),
        "spec": {
            "replicas": cfg.replicas,
            "selector": {"matchLabels": _selector(cfg)},
            # a new drafter rolls out one pod at a time; an old pod leaves only once a new one is
            # ready, and drains its streams before exiting
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {"metadata": {"labels": _labels(cfg)}, "spec": pod},
        },
    }


def _selector(cfg: DeployConfig) -> dict:
    return {"app.kubernetes.io/name": "dspark-triton", "app.kubernetes.io/instance": cfg.name}


def service(cfg: DeployConfig) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(cfg, cfg.name),
        "spec": {
            "type": "ClusterIP",
            "selector": _selector(cfg),
            "ports": [
                {"name": n, "port": p, "targetPort": n, "protocol": "TCP"}
                for n, p in (("http", 8000), ("grpc", 8001), ("metrics", 8002))
            ],
        },
    }


def service_monitor(cfg: DeployConfig) -> dict:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": _meta(cfg, cfg.name),
        "spec": {
            "selector": {"matchLabels": _selector(cfg)},
            "endpoints": [
                {
                    "port": "metrics",
                    "path": "/metrics",
                    "interval": cfg.scrape_interval,
                    "metricRelabelings": [
                        {"sourceLabels": ["__name__"], "regex": "(dspark_|nv_).*", "action": "keep"}
                    ],
                }
            ],
        },
    }


# Per-pod series the HPA reads through prometheus-adapter (custom.metrics.k8s.io). Both are gauges
# the orchestrator publishes with label model="dspark".
HPA_METRICS = ("dspark_active_sequences", "dspark_queued_requests")


def adapter_rules(cfg: DeployConfig) -> dict:
    """prometheus-adapter configuration (its `rules:`), as a ConfigMap to mount or merge into the
    adapter's own (Helm chart value `rules.custom`)."""
    rules = [
        {
            "seriesQuery": f'{m}{{namespace!="",pod!=""}}',
            "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
            "name": {"matches": f"^{m}$", "as": m},
            "metricsQuery": "max_over_time(<<.Series>>{<<.LabelMatchers>>}[1m])",
        }
        for m in HPA_METRICS
    ]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(cfg, f"{cfg.name}-prometheus-adapter-rules"),
        "data": {"config.yaml": yaml.safe_dump({"rules": rules}, sort_keys=False)},
    }


def _quantity(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{int(x * 1000)}m"


def hpa(cfg: DeployConfig) -> dict:
    active = cfg.target_active_per_pod or max(1.0, 0.75 * cfg.slots)
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _meta(cfg, cfg.name),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": cfg.name},
            "minReplicas": cfg.min_replicas,
            "maxReplicas": cfg.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": name},
                        "target": {"type": "AverageValue", "averageValue": _quantity(value)},
                    },
                }
                for name, value in zip(HPA_METRICS, (active, cfg.target_queued_per_pod))
            ],
            # scale up at once, down slowly: a pod that leaves drains its streams first
            "behavior": {
                "scaleUp": {
                    "stabilizationWindowSeconds": 0,
                    "policies": [{"type": "Pods", "value": 2, "periodSeconds": 60}],
                },
                "scaleDown": {
                    "stabilizationWindowSeconds": 300,
                    "policies": [{"type": "Pods", "value": 1, "periodSeconds": 120}],
                },
            },
        },
    }


def inference_service(cfg: DeployConfig) -> dict:
    """KServe InferenceService, raw deployment: the kserve-tritonserver runtime with our image and
    command, the repository rendered by the same initContainer (no storageUri). KServe's own HPA
    scales raw deployments on CPU only; scaling on dspark_* metrics uses the Deployment + HPA set."""
    pod = _pod_parts(cfg)
    server = dict(pod["containers"][0])
    server.pop("name")  # KServe names it kserve-container
    model = {
        "modelFormat": {"name": "triton"},
        "runtime": "kserve-tritonserver",
        "protocolVersion": "v2",
        **server,
    }
    meta = _meta(cfg, cfg.name)
    meta["annotations"] = {
        "serving.kserve.io/deploymentMode": "RawDeployment",
        "serving.kserve.io/autoscalerClass": "hpa",
    }
    return {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": meta,
        "spec": {
            "predictor": {
                "minReplicas": cfg.min_replicas,
                "maxReplicas": cfg.max_replicas,
                "model": model,
                "initContainers": pod["initContainers"],
                "volumes": pod["volumes"],
                "securityContext": pod["securityContext"],
                "terminationGracePeriodSeconds": pod["terminationGracePeriodSeconds"],
            }
        },
    }


def render_manifests(cfg: DeployConfig) -> dict[str, dict]:
    """file stem → manifest."""
    return {
        "deployment": deployment(cfg),
        "service": service(cfg),
        "servicemonitor": service_monitor(cfg),
        "hpa": hpa(cfg),
        "prometheus-adapter-rules": adapter_rules(cfg),
        "inferenceservice": inference_service(cfg),
    }


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data) -> bool:  # no &id001 anchors: plain, diffable YAML
        return True


def to_yaml(doc: dict) -> str:
    return yaml.dump(doc, Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def write_manifests(docs: dict[str, dict], out: Path) -> list[Path]:
    """One file per object, plus kubernetes.yaml (everything but the InferenceService: apply
    either that file or inferenceservice.yaml, not both)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for stem, doc in docs.items():
        path = out / f"{stem}.yaml"
        path.write_text(to_yaml(doc))
        paths.append(path)
    bundle = out / "kubernetes.yaml"
    bundle.write_text("---\n".join(to_yaml(d) for s, d in docs.items() if s != "inferenceservice"))
    return paths + [bundle]
