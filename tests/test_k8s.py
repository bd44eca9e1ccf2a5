"""Plain manifests in k8s/: generated from the chart (and checked for drift), buildable with
kustomize, and as acceptable to the API server and the operator as the chart itself."""

from __future__ import annotations

import re
import subprocess

import jsonschema
import kubernetes_validate
import pytest
import yaml
from conftest import REPO
from k8s_rules import pytorchjob_schema, webhook_problems
from trainer_v2_rules import crd_schema, trainjob_problems

from operator_scripts.generate.catalog import generated_files
from operator_scripts.generate.manifests import k8s_base_files

K8S_VERSION = "1.30.0"


def test_every_generated_file_matches_the_code_that_generates_it():
    """k8s/, the chart's values table and schema, the dashboard and the alerts."""
    for path, text in generated_files().items():
        assert path.is_file() and path.read_text() == text, (
            f"{path.relative_to(REPO)} is stale: python -m operator_scripts.generate write"
        )
    listed = sorted(p.name for p in (REPO / "k8s" / "base").glob("*.yaml"))
    assert listed == sorted(p.name for p in k8s_base_files())


@pytest.mark.parametrize("target", ["base", "overlays/two-nodes"])
def test_kustomize_builds_valid_objects(target):
    built = subprocess.run(
        ["kubectl", "kustomize", str(REPO / "k8s" / target)], capture_output=True, text=True, check=True
    ).stdout
    objects = [item for item in yaml.safe_load_all(built) if item]
    (job,) = [item for item in objects if item["kind"] == "PyTorchJob"]
    workers = 2 if target.endswith("two-nodes") else 1
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == workers
    assert (
        job["spec"]["elasticPolicy"]["minReplicas"] == job["spec"]["elasticPolicy"]["maxReplicas"] == workers
    )
    assert webhook_problems(job) == []
    jsonschema.validate(job, pytorchjob_schema())
    for item in objects:
        if item["apiVersion"] == "v1":
            kubernetes_validate.validate(item, K8S_VERSION, strict=True)


def test_the_trainjob_overlay_builds_the_runtime_before_the_trainjob_and_no_pytorchjob():
    built = subprocess.run(
        ["kubectl", "kustomize", str(REPO / "k8s" / "overlays" / "trainjob")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    objects = [item for item in yaml.safe_load_all(built) if item]
    kinds = [item["kind"] for item in objects]
    assert "PyTorchJob" not in kinds and kinds.index("TrainingRuntime") < kinds.index("TrainJob")
    (job,) = [item for item in objects if item["kind"] == "TrainJob"]
    runtimes = [item for item in objects if item["kind"] == "TrainingRuntime"]
    assert trainjob_problems(job, runtimes, kinds) == []
    jsonschema.validate(job, crd_schema("TrainJob"))
    jsonschema.validate(runtimes[0], crd_schema("TrainingRuntime"))
    assert {item["kind"] for item in objects} - {"TrainJob", "TrainingRuntime"} == {
        "ConfigMap",
        "NetworkPolicy",
        "ServiceAccount",
        "PodMonitor",
        "PrometheusRule",
    }


def test_prerequisite_manifests_are_valid_and_hold_no_real_keys():
    folder = REPO / "k8s" / "prerequisites"
    for path in sorted(folder.glob("*.yaml")):
        for item in (item for item in yaml.safe_load_all(path.read_text()) if item):
            kubernetes_validate.validate(item, K8S_VERSION, strict=True)
            if item["kind"] == "Secret":  # placeholders only, never a key
                for value in item["stringData"].values():
                    assert "REPLACE-WITH" in value and not re.search(r"AKIA[0-9A-Z]{16}", value), value
    assert "v1.9.4" in (folder / "README.md").read_text()
