"""`dspark deploy` (issue 16): the manifests of both profiles validate offline against the pinned
Kubernetes schemas and the CRD schemas in dspark/deploy/schemas; the commands they run are real
`dspark serve` command lines."""

import copy
import re

import pytest
import yaml

from dspark.cli import build_parser, main
from dspark.deploy.manifests import HPA_METRICS, DeployConfig, render_manifests
from dspark.deploy.validate import ManifestError, validate_manifest


@pytest.fixture(scope="module", params=["cpu", "gpu"])
def docs(request):
    return request.param, render_manifests(DeployConfig(profile=request.param, replicas=2))


def test_every_manifest_validates_offline(docs):
    _, d = docs
    assert set(d) == {
        "deployment",
        "service",
        "servicemonitor",
        "hpa",
        "prometheus-adapter-rules",
        "inferenceservice",
    }
    for doc in d.values():
        where = validate_manifest(doc)
        assert "strict" in where or "dspark/deploy/schemas" in where


def _server(d):
    return d["deployment"]["spec"]["template"]["spec"]["containers"][0]


def test_deployment_serves_the_repository_with_probes_shm_and_no_root(docs):
    profile, d = docs
    pod = d["deployment"]["spec"]["template"]["spec"]
    srv = _server(d)
    assert [p["containerPort"] for p in srv["ports"]] == [8000, 8001, 8002]
    assert srv["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert srv["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert srv["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in srv["volumeMounts"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    assert all(c["securityContext"]["allowPrivilegeEscalation"] is False for c in pod["containers"])
    gpus = srv["resources"]["limits"].get("nvidia.com/gpu")
    assert gpus == (1 if profile == "gpu" else None)
    # the drain: the grace period outlasts the server's exit timeout
    exit_timeout = int(next(a for a in srv["command"] if a.startswith("--exit-timeout=")).split("=")[1])
    assert pod["terminationGracePeriodSeconds"] > exit_timeout
    strategy = d["deployment"]["spec"]["strategy"]["rollingUpdate"]
    assert strategy["maxUnavailable"] == 0


def test_the_containers_run_real_dspark_serve_command_lines(docs):
    profile, d = docs
    pod = d["deployment"]["spec"]["template"]["spec"]
    init, srv = pod["initContainers"][0], pod["containers"][0]
    parser = build_parser()
    for c in (init, srv):
        assert c["command"][:2] == ["dspark", "serve"]
        parser.parse_args(c["command"][1:])  # every flag exists (SystemExit otherwise)
    a = parser.parse_args(init["command"][1:])
    assert a.render_only and a.profile == profile and a.repository.startswith("/repository")
    b = parser.parse_args(srv["command"][1:])
    assert b.no_render and b.allow_remote and b.host == "0.0.0.0" and b.repository == a.repository
    assert (b.tritonserver is not None) == (profile == "gpu")


def test_service_monitor_keeps_dspark_and_triton_metrics_only(docs):
    _, d = docs
    ep = d["servicemonitor"]["spec"]["endpoints"][0]
    assert ep["port"] == "metrics" and ep["path"] == "/metrics"
    (rule,) = ep["metricRelabelings"]
    keep = re.compile(rule["regex"])
    assert rule["action"] == "keep"
    assert keep.fullmatch("dspark_active_sequences") and keep.fullmatch("nv_inference_request_success")
    assert not keep.fullmatch("process_cpu_seconds_total")
    svc_ports = {p["name"]: p["port"] for p in d["service"]["spec"]["ports"]}
    assert svc_ports == {"http": 8000, "grpc": 8001, "metrics": 8002}


def test_hpa_scales_on_metrics_the_adapter_rules_expose(docs):
    _, d = docs
    spec = d["hpa"]["spec"]
    assert d["hpa"]["apiVersion"] == "autoscaling/v2"
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "dspark"}
    names = [m["pods"]["metric"]["name"] for m in spec["metrics"]]
    assert names == list(HPA_METRICS)
    rules = yaml.safe_load(d["prometheus-adapter-rules"]["data"]["config.yaml"])["rules"]
    assert [r["name"]["as"] for r in rules] == names
    assert all(r["resources"]["overrides"]["pod"] == {"resource": "pod"} for r in rules)
    assert spec["metrics"][0]["pods"]["target"]["averageValue"] == "12"  # 3/4 of 16 slots


def test_inference_service_is_protocol_v2_on_the_triton_runtime(docs):
    _, d = docs
    pred = d["inferenceservice"]["spec"]["predictor"]
    assert pred["model"]["protocolVersion"] == "v2"
    assert pred["model"]["runtime"] == "kserve-tritonserver"
    assert pred["model"]["modelFormat"] == {"name": "triton"}
    assert pred["initContainers"][0]["name"] == "render-repository"


def _broken(doc, path, value):
    doc = copy.deepcopy(doc)
    *head, last = path
    node = doc
    for k in head:
        node = node[k]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return doc


CONTAINER = ["spec", "template", "spec", "containers", 0]


@pytest.mark.parametrize(
    "stem, path, value, message",
    [
        ("deployment", CONTAINER + ["ports", 0, "containerPort"], "eight", "containerPort"),
        ("deployment", ["spec", "replicaCount"], 2, "replicaCount"),  # strict: unknown field
        ("deployment", CONTAINER + ["livenessProbe", "httpGet", "path"], 5, "path"),
        ("hpa", ["spec", "minReplicas"], "one", "minReplicas"),
        ("service", ["spec", "ports", 0, "port"], "http", "port"),
        ("servicemonitor", ["spec", "endpoints", 0, "interval"], "15 seconds", "interval"),
        ("servicemonitor", ["spec", "endpoints", 0, "metricRelabelings", 0, "action"], "kep", "action"),
        ("servicemonitor", ["spec", "selector"], KeyError, "selector"),
        ("servicemonitor", ["spec", "endpoints", 0, "scrapeInterval"], "15s", "scrapeInterval"),
        ("inferenceservice", ["spec", "predictor", "model", "protocolVersion"], "v3", "protocolVersion"),
        ("inferenceservice", ["spec", "predictor", "model", "modelFormat"], KeyError, "modelFormat"),
        ("inferenceservice", ["spec", "predictor", "initContainers", 0, "image"], 7, "image"),
        ("inferenceservice", ["spec", "predictor", "replicas"], 2, "replicas"),
    ],
)
def test_a_broken_manifest_fails_naming_the_field(stem, path, value, message):
    doc = _broken(render_manifests(DeployConfig())[stem], path, value)
    with pytest.raises(ManifestError, match=message):
        validate_manifest(doc)


def test_cli_writes_applyable_yaml(tmp_path, capsys):
    assert main(["deploy", "--profile", "gpu", "--out", str(tmp_path), "--replicas", "3"]) == 0
    out = capsys.readouterr().out
    assert out.count("valid:") == 6
    docs = list(yaml.safe_load_all((tmp_path / "kubernetes.yaml").read_text()))
    assert [d["kind"] for d in docs] == [
        "Deployment",
        "Service",
        "ServiceMonitor",
        "HorizontalPodAutoscaler",
        "ConfigMap",
    ]
    assert docs[0]["spec"]["replicas"] == 3
    assert "&id" not in (tmp_path / "deployment.yaml").read_text()  # no YAML anchors
    isvc = yaml.safe_load((tmp_path / "inferenceservice.yaml").read_text())
    validate_manifest(isvc)
    assert main(["deploy", "--min-replicas", "5", "--max-replicas", "2", "--out", str(tmp_path)]) == 2
