"""The chart's PyTorchJob against what would admit it: the CRD's schema, the operator's
webhook rules and its SDK model; and its built-in objects and pod templates against
Kubernetes' own schemas, strictly."""

from __future__ import annotations

import copy
import json

import jsonschema
import kubernetes_validate
import pytest
from chart_scenarios import K8S_VERSION, SCENARIOS, pod_templates, scenario
from k8s_rules import pytorchjob_schema, webhook_problems

from operator_scripts.chart.render import render

# ----- the PyTorchJob as the operator sees it --------------------------------------------


@pytest.fixture(scope="module")
def crd_schema():
    return pytorchjob_schema()


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.name for p in SCENARIOS])
def test_pytorchjob_passes_the_crd_schema_strictly(path, crd_schema):
    job = scenario(path).one("PyTorchJob")
    jsonschema.validate(job, crd_schema)


def test_the_strict_schema_catches_an_unknown_field(crd_schema):
    job = render().one("PyTorchJob")
    job["spec"]["elasticPolicy"]["nProcPerNodes"] = 8
    with pytest.raises(jsonschema.ValidationError, match="nProcPerNodes"):
        jsonschema.validate(job, crd_schema)


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.name for p in SCENARIOS])
def test_pytorchjob_meets_the_operators_rules(path):
    job = scenario(path).one("PyTorchJob")
    assert webhook_problems(job) == []


def test_the_rule_checker_catches_what_the_webhook_rejects():
    job = render().one("PyTorchJob")
    broken = copy.deepcopy(job)
    broken["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["name"] = "trainer"
    broken["spec"]["elasticPolicy"]["nProcPerNode"] = 1
    broken["metadata"]["name"] = "Ddp_Run"
    assert len(webhook_problems(broken)) == 3


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.name for p in SCENARIOS])
def test_pytorchjob_round_trips_through_the_kubeflow_sdk_model(path):
    from kubeflow.training.api_client import ApiClient

    job = scenario(path).one("PyTorchJob")

    class Response:
        data = json.dumps(job)

    client = ApiClient()
    model = client.deserialize(Response(), "KubeflowOrgV1PyTorchJob")
    assert client.sanitize_for_serialization(model) == job


# ----- built-in kinds, strictly ------------------------------------------------------------


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.name for p in SCENARIOS])
def test_builtin_objects_and_pod_templates_pass_kubernetes_validate_strictly(path):
    rendered = scenario(path)
    builtin = [
        o
        for o in rendered.objects
        if o["apiVersion"] in {"v1", "apps/v1", "rbac.authorization.k8s.io/v1", "networking.k8s.io/v1"}
    ]
    assert builtin
    for item in builtin:
        kubernetes_validate.validate(item, K8S_VERSION, strict=True)
    for kind, template in pod_templates(rendered.one("PyTorchJob")).items():
        pod_template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": kind.lower()},
            "template": template,
        }
        kubernetes_validate.validate(pod_template, K8S_VERSION, strict=True)


def test_strict_validation_catches_an_unknown_pod_field():
    template = pod_templates(render().one("PyTorchJob"))["Worker"]
    template["spec"]["containers"][0]["gpus"] = 8
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(
            {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "w"}, "template": template},
            K8S_VERSION,
            strict=True,
        )
