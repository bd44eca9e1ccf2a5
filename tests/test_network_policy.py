"""The job's NetworkPolicy as the chart renders it: on by default for both kinds, valid
networking/v1, selecting exactly one install's pods, checkov's CKV2_K8S_6 met; the values
it refuses; and the rules `ddp-ops local` derives from it as a CNI would (network_policy)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from chart_scenarios import K8S_VERSION, pod_templates
from conftest import REPO
from helm_python import HelmError
from trainer_v2_rules import node_job

from operator_scripts.chart.render import merge_values, render
from operator_scripts.local.network_policy import Endpoint, peer_endpoints, ruleset, selecting

KINDS = ["PyTorchJob", "TrainJob"]
DIGEST = "sha256:" + "ab" * 32


def rendered(sets: str = "", release: str = "ddp-run", namespace: str = "training"):
    return render(merge_values(sets=[sets] if sets else []), release=release, namespace=namespace)


def job_pod_templates(chart) -> list[dict]:
    """Every pod template the chart's job has: a PyTorchJob's replicas', a TrainJob's node Job's."""
    if chart.of_kind("PyTorchJob"):
        return list(pod_templates(chart.one("PyTorchJob")).values())
    return [node_job(chart.one("TrainingRuntime"))["template"]["spec"]["template"]]


def endpoints_of(chart, namespace: str, first: int) -> list[Endpoint]:
    """The chart's pods as the policy engine sees them, at 10.0.0.N onwards."""
    templates = job_pod_templates(chart)
    return [
        Endpoint(f"pod-{first + i}", namespace, template["metadata"]["labels"], f"10.0.0.{first + i}")
        for i, template in enumerate(templates)
    ]


@pytest.mark.parametrize("kind", KINDS)
def test_the_default_policy_is_valid_and_selects_the_jobs_pods_in_and_out(kind):
    chart = rendered(f"jobKind={kind},mode=fixed,gpus=16" if kind == "PyTorchJob" else f"jobKind={kind}")
    policy = chart.one("NetworkPolicy")
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    pods = endpoints_of(chart, "training", 2)
    assert len(pods) == (2 if kind == "PyTorchJob" else 1)  # a Master's and a Worker's templates
    assert all(selecting([policy], pod) == [policy] for pod in pods)
    own = policy["spec"]["ingress"][0]
    assert own["ports"] == [{"protocol": "TCP"}] and peer_endpoints(own["from"][0], "training", pods) == pods
    # the rendezvous port, gloo's and NCCL's: every TCP port between the job's pods, both ways
    assert policy["spec"]["egress"][0] == {"to": own["from"], "ports": [{"protocol": "TCP"}]}


def test_two_installs_in_one_namespace_neither_select_nor_admit_each_others_pods():
    first, second = rendered(release="first"), rendered(release="second")
    ours, theirs = endpoints_of(first, "training", 2), endpoints_of(second, "training", 3)
    policy = first.one("NetworkPolicy")
    assert selecting([policy, second.one("NetworkPolicy")], ours[0]) == [policy]
    table = ruleset(ours[0], [policy, second.one("NetworkPolicy")], ours + theirs, node="10.0.0.1")
    assert "-s 10.0.0.2/32 -p tcp -j ACCEPT" in table and "10.0.0.3" not in table
    # the same labels in another namespace are another job
    elsewhere = Endpoint("x", "other", ours[0].labels, "10.0.0.9")
    assert "10.0.0.9" not in ruleset(ours[0], [policy], [*ours, elsewhere], node="10.0.0.1")


def test_the_metrics_port_admits_only_the_named_prometheus_and_egress_keeps_off_the_metadata_service():
    policy = rendered("metrics.port=9500").one("NetworkPolicy")
    pod = endpoints_of(rendered("metrics.port=9500"), "training", 2)[0]
    prometheus = Endpoint("prom", "monitoring", {"app.kubernetes.io/name": "prometheus"}, "10.0.0.7")
    impostor = Endpoint("fake", "training", {"app.kubernetes.io/name": "prometheus"}, "10.0.0.8")
    table = ruleset(pod, [policy], [pod, prometheus, impostor], node="10.0.0.1")
    assert "-A INPUT -s 10.0.0.7/32 -p tcp --dport 9500 -j ACCEPT" in table and "10.0.0.8" not in table
    # S3 on 443 anywhere public, never the link-local range where the metadata service is
    assert (
        "-A BLOCK-1 -d 169.254.0.0/16 -j RETURN" in table
        and "-A BLOCK-1 -p tcp --dport 443 -j ACCEPT" in table
    )
    # and the node's probes get in whatever the policy says
    assert table.index("-A INPUT -s 10.0.0.1/32 -j ACCEPT") < table.index("-A INPUT -j DROP")


def test_a_trainjob_reaches_only_trainers_status_server_and_the_api_server_reaches_metrics_when_named():
    """A TrainJob's pods post to the controller's pods in kubeflow-system on 10443 (not to an
    impostor with its labels elsewhere, nor another port); a PyTorchJob's have no such rule.
    The API server's pod proxy reaches the metrics port only from `networkPolicy.apiServer`."""
    trainjob = rendered("jobKind=TrainJob")
    policy, pod = trainjob.one("NetworkPolicy"), endpoints_of(trainjob, "training", 2)[0]
    labels = {"app.kubernetes.io/name": "trainer", "app.kubernetes.io/component": "manager",
              "app.kubernetes.io/part-of": "kubeflow"}  # fmt: skip
    controller = Endpoint("manager", "kubeflow-system", labels, "10.0.0.7")
    impostor = Endpoint("fake", "training", labels, "10.0.0.8")
    table = ruleset(pod, [policy], [pod, controller, impostor], node="10.0.0.1")
    assert "-A OUTPUT -d 10.0.0.7/32 -p tcp --dport 10443 -j ACCEPT" in table and "10.0.0.8" not in table
    assert "10443" not in json.dumps(rendered().one("NetworkPolicy"))  # a PyTorchJob posts nowhere
    assert "10443" not in json.dumps(
        rendered("jobKind=TrainJob,networkPolicy.trainerStatusServer=null").objects
    )

    control_plane = "networkPolicy.apiServer[0].ipBlock.cidr=172.20.0.0/28,metrics.port=9500"
    ingress = rendered(control_plane).one("NetworkPolicy")["spec"]["ingress"]
    proxied = [rule for rule in ingress if {"ipBlock": {"cidr": "172.20.0.0/28"}} in rule["from"]]
    assert len(proxied) == 1 and proxied[0]["ports"] == [{"port": 9500, "protocol": "TCP"}]


def test_an_endpoint_given_as_an_address_is_let_through_on_its_port_and_pod_identity_when_asked():
    egress = rendered(
        "checkpoint.s3.bucket=b,checkpoint.s3.endpoint=http://10.9.8.7:9000,networkPolicy.podIdentity=true"
    ).one("NetworkPolicy")["spec"]["egress"]
    assert {
        "to": [{"ipBlock": {"cidr": "10.9.8.7/32"}}],
        "ports": [{"port": 9000, "protocol": "TCP"}],
    } in egress
    agent = [rule for rule in egress if {"ipBlock": {"cidr": "169.254.170.23/32"}} in rule["to"]]
    assert agent and agent[0]["ports"] == [{"port": 80, "protocol": "TCP"}]
    minio = rendered(
        "checkpoint.s3.bucket=b,checkpoint.s3.endpoint=http://minio.training.svc:9000,"
        "networkPolicy.storage.to[0].podSelector.matchLabels.app=minio,networkPolicy.storage.ports[0].port=9000"
    ).one("NetworkPolicy")
    assert {"to": [{"podSelector": {"matchLabels": {"app": "minio"}}}], "ports": [{"port": 9000}]} in minio[
        "spec"
    ]["egress"]


def test_checkov_finds_every_pod_template_under_a_policy_and_none_without():
    """checkov's CKV2_K8S_6 on the job's pod templates, extracted as plain Pods (checkov does
    not look inside a PyTorchJob or a TrainJob), with and without the chart's policy."""
    checkov = shutil.which("checkov") or str(REPO / ".venv" / "checkov" / "bin" / "checkov")
    assert os.access(checkov, os.X_OK), "checkov is not installed: `make test` installs it in .venv/checkov"
    folders = {}
    for enabled in (True, False):
        folder = Path(os.environ["TMPDIR"]) / f"checkov-{enabled}-{os.getpid()}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        for kind in KINDS:
            chart = rendered(
                f"jobKind={kind},mode=fixed,gpus=16,networkPolicy.enabled={str(enabled).lower()}"
            )
            assert "checkov:skip" not in chart.manifest
            documents = [
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {
                        "name": f"{kind.lower()}-{i}",
                        "namespace": "training",
                        **template["metadata"],
                    },
                    "spec": template["spec"],
                }
                for i, template in enumerate(job_pod_templates(chart))
            ]
            documents += chart.of_kind("NetworkPolicy")
            (folder / f"{kind}.yaml").write_text(yaml.safe_dump_all(documents))
        folders[enabled] = folder
    results = {}
    for enabled, folder in folders.items():
        command = [checkov, "-d", str(folder), "--framework", "kubernetes", "--check", "CKV2_K8S_6"]
        done = subprocess.run([*command, "-o", "json", "--skip-download"], capture_output=True, text=True)
        report = json.loads(done.stdout)["results"]
        results[enabled] = {
            outcome: sorted(check["resource"] for check in report[f"{outcome}_checks"])
            for outcome in ("passed", "failed")
        }
    pods = ["Pod.training.pytorchjob-0", "Pod.training.pytorchjob-1", "Pod.training.trainjob-0"]
    assert results[True] == {"passed": pods, "failed": []}
    assert results[False] == {"passed": [], "failed": pods}  # the check can fail


REFUSED = [  # (values as YAML, what the one line says)
    ("networkPolicy: {extraIngress: [{ports: [{port: 8888}]}]}", "networkPolicy.extraIngress[0]: no `from`"),
    ("networkPolicy: {extraEgress: [{ports: [{port: 443}]}]}", "networkPolicy.extraEgress[0]: no `to`"),
    (
        "networkPolicy: {extraIngress: [{from: [{}]}]}",
        "networkPolicy.extraIngress[0].from[0]={}: a peer names pods",
    ),
    (
        "networkPolicy: {prometheus: {podSelector: {matchLabels: null}}}",
        "selects every pod of the namespaces it selects",
    ),
    ("networkPolicy: {healthFrom: [{podSelector: {}}]}", "selects every pod in the job's namespace"),
    ("networkPolicy: {extraIngress: [{from: [{ipBlock: {cidr: 0.0.0.0/0}}]}]}", "admits every address"),
    (
        "networkPolicy: {storage: {to: [{ipBlock: {cidr: 0.0.0.0/0}}]}}",
        "instance metadata service (169.254.169.254)",
    ),
    (
        "networkPolicy: {extraEgress: [{to: [{ipBlock: {cidr: 169.254.169.0/24}}]}]}",
        "instance metadata service",
    ),
    ("networkPolicy: {prometheus: {podSelector: {matchLabels: {app: -x}}}}", "app=-x is no label value"),
    (
        "networkPolicy: {dns: [{podSelector: {matchLabels: {k8s-app: kube-dns}, "
        "matchExpressions: [{key: k8s-app, operator: DoesNotExist}]}}]}",
        "matchLabels k8s-app=kube-dns and the expression k8s-app DoesNotExist",
    ),
    (
        "networkPolicy: {extraIngress: [{from: [{podSelector: {matchExpressions: "
        "[{key: a, operator: In}]}}]}]}",
        "a In []: no value to match",
    ),
    ("networkPolicy: {dns: []}", "networkPolicy.dns=[]: the pods could resolve no name"),
    ("networkPolicy: {apiServer: [{ipBlock: {cidr: 0.0.0.0/0}}]}", "admits every address"),
    (
        "{jobKind: TrainJob, networkPolicy: {trainerStatusServer: {podSelector: {matchLabels: null}}}}",
        "selects every pod of the namespaces it selects",
    ),
    ("checkpoint: {s3: {bucket: b, endpoint: 'http://minio:9000'}}", "port 9000 is not among them"),
    ("checkpoint: {s3: {accessKeyIdKey: KEY}}", "only as a credentials file"),
    ("{mode: fixed, gpus: 16, podSecurityStandard: restricted}", "the restricted standard refuses"),
    ("image: {digest: 'sha256:abc'}", "image.digest=sha256:abc: not an image digest"),
]


@pytest.mark.parametrize(("values", "message"), REFUSED, ids=[message for _, message in REFUSED])
def test_bad_values_are_refused_at_render_in_one_line_naming_the_value(values, message):
    with pytest.raises(HelmError) as failure:
        render(yaml.safe_load(values), release="ddp-run", namespace="training")
    error = str(failure.value)
    assert message in error and len(error.strip().splitlines()) == 1, error


def test_a_policy_turned_off_says_what_is_then_reachable_and_restricted_takes_elastic_and_trainjob():
    notes = rendered("networkPolicy.enabled=false").notes
    assert not rendered("networkPolicy.enabled=false").of_kind("NetworkPolicy")
    assert "every pod in the cluster can reach this job's pods: the\nrendezvous store on port 23456" in notes
    assert "networkPolicy.enabled=false" not in rendered().notes
    assert '"kubernetes.io/metadata.name":"monitoring"' in rendered().notes  # whom it lets scrape
    assert "init container (init-pytorch)" in rendered("mode=fixed,gpus=16").notes
    for sets in (
        "podSecurityStandard=restricted",
        "podSecurityStandard=restricted,jobKind=TrainJob,mode=fixed",
    ):
        assert "init-pytorch" not in rendered(sets).notes


@pytest.mark.parametrize("kind", KINDS)
def test_an_image_digest_names_the_image_by_its_bytes_everywhere(kind):
    chart = rendered(f"jobKind={kind},image.digest={DIGEST},image.tag=ignored")
    named = set(re.findall(r'ghcr\.io/ddp-trainer/ddp-trainer[^\s"]*', chart.manifest))
    assert named == {f"ghcr.io/ddp-trainer/ddp-trainer@{DIGEST}"}
    assert len(re.findall(re.escape(DIGEST), chart.manifest)) == (2 if kind == "PyTorchJob" else 3)


def test_the_engine_reads_expressions_named_ports_ranges_excepts_and_policy_types():
    """The policy semantics `ddp-ops local` enforces, on a hand-written policy: what selects,
    what a named port and an endPort range become, an ipBlock less its except, and that a
    policy with ingress rules only isolates no egress (its default policyTypes)."""
    policy = {
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": {
            "podSelector": {"matchExpressions": [{"key": "tier", "operator": "In", "values": ["a", "b"]}]},
            "ingress": [
                {
                    "from": [
                        {"podSelector": {"matchExpressions": [{"key": "debug", "operator": "DoesNotExist"}]}}
                    ],
                    "ports": [{"port": "metrics"}, {"port": 7000, "endPort": 7010, "protocol": "UDP"}],
                },
                {"from": [{"ipBlock": {"cidr": "10.0.0.0/24", "except": ["10.0.0.128/25"]}}]},
            ],
        },
    }
    pod = Endpoint("pod", "ns", {"tier": "a"}, "10.0.0.2", {"metrics": (9401, "TCP")})
    peer = Endpoint("peer", "ns", {"tier": "c"}, "10.0.0.3")
    debugger = Endpoint("debugger", "ns", {"tier": "c", "debug": "1"}, "10.0.0.4")
    untouched = Endpoint("other", "ns", {"tier": "c"}, "10.0.0.5")
    table = ruleset(pod, [policy], [pod, peer, debugger], node="10.0.0.1")
    assert "-A INPUT -s 10.0.0.3/32 -p tcp --dport 9401 -j ACCEPT" in table
    assert "-A INPUT -s 10.0.0.3/32 -p udp --dport 7000:7010 -j ACCEPT" in table
    assert "10.0.0.4" not in table  # matches DoesNotExist's opposite
    assert "-A INPUT -s 10.0.0.0/24 -j BLOCK-1" in table and "-A BLOCK-1 -s 10.0.0.128/25 -j RETURN" in table
    assert "-A BLOCK-1 -j ACCEPT" in table  # no ports: every port of every protocol
    assert "OUTPUT" not in table.split("COMMIT")[0].split(":OUTPUT ACCEPT [0:0]")[1]  # egress not isolated
    assert ruleset(untouched, [policy], [pod, untouched], node="10.0.0.1").count("-A ") == 0
