"""What Kubeflow Trainer v2.3.0 and JobSet v0.12.0 accept: their CRD schemas made strict,
and the rules their webhooks and the Job API enforce, which no API server here checks, as
checks on a rendered TrainJob and its runtime. Sources at tag v2.3.0 of kubeflow/trainer
and v0.12.0 of kubernetes-sigs/jobset (docs/facts.md, "Kubeflow Trainer v2")."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from k8s_rules import DNS_1035, strict
from loopback_api import status

SCHEMAS = Path(__file__).resolve().parents[1] / "schemas"
CRDS = {  # manifests/base/crds/ at tag v2.3.0 (commit 658725bd), tests/schemas/README.md
    "TrainJob": (
        "trainer.kubeflow.org_trainjobs.yaml",
        "a742cafc5b5582640c7e0b7467c024fc237256fbca5ba0a9f0531dfb66d64416",
    ),
    "TrainingRuntime": (
        "trainer.kubeflow.org_trainingruntimes.yaml",
        "69b8dbdf60a18e28cddcc2b8dfc4ce72a943e14b531b9389d593118faee4919f",
    ),
}
# pkg/constants/constants.go:191-203; refused in trainer.env by the torch plugin (torch.go:66-77)
RESERVED_ENV = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}
ANCESTOR_LABEL, NODE = "trainer.kubeflow.org/trainjob-ancestor-step", "node"  # constants.go:41, 69


def crd_schema(kind: str) -> dict:
    """The v1alpha1 openAPIV3Schema of `kind`'s CRD, strict; the file must be the one
    tests/schemas/README.md names."""
    name, sha256 = CRDS[kind]
    data = (SCHEMAS / name).read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    assert digest == sha256, (
        f"{name} is not the Trainer v2.3.0 CRD (sha256 {digest}); see tests/schemas/README.md"
    )
    (version,) = yaml.safe_load(data)["spec"]["versions"]
    return strict(version["schema"]["openAPIV3Schema"])


def node_job(runtime: dict) -> dict:
    """The runtime's trainer Job (the replicated job the PET_* variables go to)."""
    jobs = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    (job,) = [
        j
        for j in jobs
        if j["template"].get("metadata", {}).get("labels", {}).get(ANCESTOR_LABEL) == "trainer"
    ]
    return job


def node_container(runtime: dict) -> dict:
    (container,) = [
        c
        for c in node_job(runtime)["template"]["spec"]["template"]["spec"]["containers"]
        if c["name"] == NODE
    ]
    return container


def trainjob_problems(job: dict, runtimes: list[dict], order: list[str]) -> list[str]:
    """Each rule a TrainJob and the runtime it names break; `order` is the kinds in the
    order they reach the API server."""
    problems = []
    name, spec = job["metadata"]["name"], job["spec"]
    if not DNS_1035.match(name) or len(name) > 63:  # trainjob_types.go:36-37
        problems.append(f"name {name} is not a DNS-1035 label")
    trainer = spec.get("trainer")
    if trainer is None:  # without it the torch plugin injects no PET_* (torch.go:138-146)
        return [*problems, "no spec.trainer"]
    nodes = trainer.get("numNodes", 1)
    pod = f"{name}-{NODE}-0-{nodes - 1}-abcde"  # jobset_webhook.go:243-255
    if len(pod) > 63:
        problems.append(f"pod name {pod} is over 63 characters")
    if not isinstance(trainer.get("numProcPerNode"), int):  # int32 since v2.2 (trainjob_types.go:288)
        problems.append(f"numProcPerNode {trainer.get('numProcPerNode')!r} is not an integer")
    gpus = trainer.get("resourcesPerNode", {}).get("limits", {}).get("nvidia.com/gpu")
    if gpus is not None and str(trainer.get("numProcPerNode")) != str(gpus):
        problems.append(f"numProcPerNode {trainer.get('numProcPerNode')} != GPUs per node {gpus}")
    if reserved := RESERVED_ENV & {e["name"] for e in trainer.get("env", [])}:
        problems.append(f"trainer.env sets reserved {sorted(reserved)}")
    for patch in spec.get("runtimePatches", []):  # trainjob_types.go:477-478
        for replicated in (
            patch.get("trainingRuntimeSpec", {}).get("template", {}).get("spec", {}).get("replicatedJobs", [])
        ):
            pod_patch = replicated.get("template", {}).get("spec", {}).get("template", {}).get("spec", {})
            if any(c.get("name") == NODE and "env" in c for c in pod_patch.get("containers", [])):
                problems.append("a runtimePatch sets env on container node")
    ref = spec["runtimeRef"]
    kind = ref.get("kind", "ClusterTrainingRuntime")
    named = [r for r in runtimes if r["kind"] == kind and r["metadata"]["name"] == ref["name"]]
    if not named:  # trainingruntime.go:306-320: the runtime must exist before the TrainJob
        return [*problems, f"runtime {kind}/{ref['name']} is not rendered"]
    if order.index(kind) > order.index("TrainJob"):
        problems.append(f"{kind} reaches the API server after the TrainJob")
    return problems + runtime_problems(named[0])


def runtime_problems(runtime: dict) -> list[str]:
    """The rules a (Cluster)TrainingRuntime for torchrun breaks: its torch policy and
    trainer job, JobSet's TTL on v2.3.0, and the Job API's podFailurePolicy rules."""
    problems = []
    spec = runtime["spec"]
    if "torch" not in spec.get("mlPolicy", {}):
        problems.append("mlPolicy has no torch policy: no PET_* variables")
    if "ttlSecondsAfterFinished" in spec["template"]["spec"]:  # kubeflow/trainer#3779
        problems.append("the JobSet has a TTL: Trainer v2.3.0 re-creates it without bound")
    try:
        job, container = node_job(runtime), node_container(runtime)
    except ValueError:
        return [*problems, "no single trainer job with one container named node"]
    if reserved := RESERVED_ENV & {e["name"] for e in container.get("env", [])}:
        problems.append(f"the node container sets reserved {sorted(reserved)}")
    if container.get("command", [])[:1] != ["ddp-launch"]:
        problems.append("command must be exec-form ddp-launch (which runs torchrun)")
    if any(p.get("containerPort") == 29500 for p in container.get("ports", [])):
        problems.append("port 29500 is declared: Trainer adds it (torch.go:203)")
    job_spec = job["template"]["spec"]
    restart = job_spec["template"]["spec"].get("restartPolicy")
    if restart not in ("Never", "OnFailure"):  # a Job's pods (batch/v1 validation)
        problems.append(f"pod restartPolicy {restart!r}: a Job takes Never or OnFailure")
    policy = job_spec.get("podFailurePolicy")
    if policy is not None:
        if restart != "Never":  # the Job API: podFailurePolicy needs restartPolicy Never
            problems.append("podFailurePolicy with restartPolicy other than Never")
        problems += exit_code_problems(
            policy, {c["name"] for c in job_spec["template"]["spec"]["containers"]}
        )
    return problems


def exit_code_problems(policy: dict[str, Any], containers: set[str]) -> list[str]:
    """The Job API's rules for onExitCodes (batch/v1 PodFailurePolicyOnExitCodesRequirement)."""
    problems = []
    for rule in policy["rules"]:
        codes = rule.get("onExitCodes")
        if codes is None:
            continue
        values = codes["values"]
        if values != sorted(set(values)) or not 1 <= len(values) <= 255:
            problems.append("onExitCodes values must be sorted, unique, 1 to 255 of them")
        if codes["operator"] == "In" and 0 in values:
            problems.append("onExitCodes In may not list 0")
        if codes.get("containerName") not in (None, *containers):
            problems.append(f"onExitCodes names container {codes.get('containerName')}, which the pod lacks")
    return problems


def trainer_admission(cache_lag: int = 1) -> Callable[..., tuple[int, dict] | None]:
    """An `ObjectApi` admission for Trainer v2.3.0: a TrainJob's runtime must exist in the
    webhook's cache (pkg/runtime/core/trainingruntime.go:305-313; the cache lags: the first
    `cache_lag` creates after the runtime appeared are refused as if it were not there), and
    its runtimeRef, initializer and trainer never change (CEL `self == oldSelf`,
    trainjob_types.go:104-114). Errors as the API server words them."""
    refusals = {"left": cache_lag}

    def admit(key, stored, applied, objects) -> tuple[int, dict] | None:
        namespace, plural, name = key
        if plural != "trainjobs":
            return None
        if stored is not None:
            changed = [
                f
                for f in ("runtimeRef", "initializer", "trainer")
                if stored["spec"].get(f) != applied["spec"].get(f)
            ]
            if changed:
                causes = "; ".join(f'spec.{f}: Invalid value: "object": field is immutable' for f in changed)
                return 422, status(
                    422, "Invalid", f'TrainJob.trainer.kubeflow.org "{name}" is invalid: {causes}'
                )
            return None
        runtime = applied["spec"]["runtimeRef"]["name"]
        if (namespace, "trainingruntimes", runtime) not in objects or refusals["left"] > 0:
            refusals["left"] -= 1
            message = (
                'admission webhook "validate.trainjob.trainer.kubeflow.org" denied the request: '
                f'spec.RuntimeRef: Invalid value: trainingruntimes.trainer.kubeflow.org "{runtime}" '
                "not found: "
                "specified trainingRuntime must be created before the TrainJob is created"
            )
            return 422, status(422, "Invalid", message)
        return None

    return admit
