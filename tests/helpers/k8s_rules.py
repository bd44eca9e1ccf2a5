"""What the Kubeflow training operator v1.9.4 accepts: its CRD schema made strict, and its
webhook's rules plus the cautions of docs/facts.md, as checks on a PyTorchJob; and the core
API's rule for the chart's immutable ConfigMap."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import yaml

# the operator's CRD at tag v1.9.4, in the repository with its source (tests/schemas/README.md)
CRD_FILE = Path(__file__).resolve().parents[1] / "schemas" / "kubeflow.org_pytorchjobs.yaml"
CRD_SHA256 = "8b8a8a719cc94173169290251e817f7ac2bb425c20b6c2fa813397bcf4e932ed"
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def strict(schema):
    """The CRD's schema refusing unknown fields, as the API server's strict field validation
    does: objects with listed properties get additionalProperties false unless they preserve
    unknown fields."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: strict(value) for key, value in schema.items()}
    if (
        result.get("type") == "object"
        and "properties" in result
        and "additionalProperties" not in result
        and not result.get("x-kubernetes-preserve-unknown-fields")
    ):
        result["additionalProperties"] = False
    return result


def pytorchjob_schema() -> dict:
    """The v1 openAPIV3Schema of the operator's CRD, strict. The file must be the one
    tests/schemas/README.md names: a missing or edited copy is an error, not a skip."""
    data = CRD_FILE.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    assert digest == CRD_SHA256, f"{CRD_FILE} is not the v1.9.4 CRD (sha256 {digest}); see its README"
    crd = yaml.safe_load(data)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return strict(version["schema"]["openAPIV3Schema"])


def webhook_problems(job: dict) -> list[str]:
    """The training operator v1.9.4 webhook's rules and the cautions of docs/facts.md."""
    problems = []
    name, spec = job["metadata"]["name"], job["spec"]
    if not DNS_1035.match(name) or len(name) > 63:
        problems.append(f"name {name} is not a DNS-1035 label")
    replicas = spec["pytorchReplicaSpecs"]
    if "Master" in replicas and replicas["Master"].get("replicas") != 1:
        problems.append("Master replicas must be explicitly 1")
    if "Worker" in replicas and replicas["Worker"].get("replicas", 0) < 1:
        problems.append("Worker replicas must be at least 1")
    if set(replicas) - {"Master", "Worker"}:
        problems.append(f"unknown replica types {set(replicas)}")
    if "elasticPolicy" in spec and "Worker" not in replicas:
        problems.append("elasticPolicy needs a Worker spec")
    if spec.get("elasticPolicy", {}).get("nProcPerNode") is not None and "nprocPerNode" in spec:
        problems.append("both elasticPolicy.nProcPerNode and spec.nprocPerNode")
    if "runPolicy" not in spec:
        problems.append("no runPolicy")
    if "standalone" in json.dumps(spec):
        problems.append("standalone is set")
    for kind, replica in replicas.items():
        containers = [c for c in replica["template"]["spec"]["containers"] if c["name"] == "pytorch"]
        if len(containers) != 1 or not containers[0].get("image"):
            problems.append(f"{kind}: needs one container named pytorch with an image")
            continue
        ports = {p["name"]: p["containerPort"] for p in containers[0].get("ports", [])}
        if "pytorchjob-port" not in ports:
            problems.append(f"{kind}: no port named pytorchjob-port")
        gpus = containers[0].get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        if gpus is not None and spec.get("nprocPerNode") != str(gpus):
            problems.append(f"{kind}: nprocPerNode {spec.get('nprocPerNode')} != GPUs per pod {gpus}")
        if spec.get("nprocPerNode") == "auto":
            problems.append("nprocPerNode auto")
        command = containers[0].get("command", [])
        if not isinstance(command, list) or command[:1] != ["ddp-launch"]:
            problems.append(f"{kind}: command must be exec-form ddp-launch (which runs torchrun)")
    return problems


def configmap_admission():
    """An `ObjectApi` admission with the core API's rule for an immutable ConfigMap (the
    chart's `--code` one): its data and binaryData never change, ValidateConfigMapUpdate in
    kubernetes pkg/apis/core/validation/validation.go, worded as the API server words it."""
    from loopback_api import status

    def admit(key, stored, applied, objects):
        _, plural, name = key
        if plural != "configmaps" or stored is None or not stored.get("immutable"):
            return None
        if any(stored.get(field) != applied.get(field) for field in ("data", "binaryData")):
            message = (
                f'ConfigMap "{name}" is invalid: data: Forbidden: field is immutable when `immutable` is set'
            )
            return 422, status(422, "Invalid", message)
        return None

    return admit
