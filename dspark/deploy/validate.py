"""Offline validation of the rendered manifests.

Built-in kinds: the Kubernetes JSON schemas bundled in `kubernetes-validate` (strict: unknown
fields fail), for Kubernetes K8S_VERSION. CRDs (ServiceMonitor, InferenceService): the schemas in
dspark/deploy/schemas (see SOURCES.md there), whose embedded Kubernetes types resolve into the same
bundled definitions.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

K8S_VERSION = "1.31"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
CRDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring.coreos.com-v1.json",
    ("serving.kserve.io/v1beta1", "InferenceService"): "inferenceservice-serving.kserve.io-v1beta1.json",
}


class ManifestError(ValueError):
    pass


def _where(err) -> str:
    return "/".join(str(p) for p in err.absolute_path) or "(top)"


@cache
def _definitions():
    import importlib.resources

    from referencing import Registry, Resource

    root = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema"
    path = root / f"v{K8S_VERSION}.0-local-strict" / "_definitions.json"
    defs = json.loads(path.read_text())
    return Registry().with_resource(defs["$id"], Resource.from_contents(defs))


def validate_manifest(doc: dict) -> str:
    """Returns what it was validated against; raises ManifestError naming the field."""
    import jsonschema

    key = (doc.get("apiVersion"), doc.get("kind"))
    name = f"{key[1]} {doc.get('metadata', {}).get('name')}"
    if key in CRDS:
        schema = json.loads((SCHEMAS / CRDS[key]).read_text())
        validator = jsonschema.Draft202012Validator(schema, registry=_definitions())
        errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
        if errors:
            e = errors[0]
            raise ManifestError(f"{name}: {_where(e)}: {e.message}")
        return f"dspark/deploy/schemas/{CRDS[key]}"
    import kubernetes_validate

    try:
        version = kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        raise ManifestError(f"{name}: {_where(e)}: {e.message}") from None
    except kubernetes_validate.SchemaNotFoundError as e:
        raise ManifestError(f"{name}: {e.message}") from None
    return f"kubernetes {version} (strict)"
