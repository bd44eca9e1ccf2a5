"""The chart as a Kubeflow Trainer v2 TrainJob (jobKind=TrainJob): every CI scenario that can
be one renders as one, and passes the v2.3.0 CRDs' schemas strictly, the rules of Trainer's
and JobSet's webhooks and of the Job API (tests/helpers/trainer_v2_rules.py), a round trip
through the kubeflow SDK's v2 models and Kubernetes' own pod schema; a value a TrainJob
cannot take is refused in one line that names it."""

from __future__ import annotations

import copy

import jsonschema
import kubernetes_validate
import pytest
from chart_scenarios import K8S_VERSION, SCENARIOS
from helm_python import HelmError
from trainer_v2_rules import crd_schema, node_container, node_job, trainjob_problems

from operator_scripts.chart.render import merge_values, render

# scenarios that set what a TrainJob cannot take, and the value its refusal names first
REFUSED = {"irsa-kueue-gang-values.yaml": "elastic.minNodes=1, elastic.maxNodes=4"}
TRAINJOB_SCENARIOS = [p for p in SCENARIOS if p.name not in REFUSED]


def as_trainjob(path, *sets: str):
    return render(
        merge_values(files=[path], sets=["jobKind=TrainJob", *sets]), release="ddp-run", namespace="training"
    )


def kinds_in_order(rendered) -> list[str]:
    return [item["kind"] for item in rendered.objects]


@pytest.fixture(scope="module")
def schemas():
    return {kind: crd_schema(kind) for kind in ("TrainJob", "TrainingRuntime")}


@pytest.fixture(scope="module")
def rendered():
    return {path.name: as_trainjob(path) for path in TRAINJOB_SCENARIOS}


@pytest.mark.parametrize("path", TRAINJOB_SCENARIOS, ids=[p.name for p in TRAINJOB_SCENARIOS])
def test_trainjob_and_its_runtime_pass_the_v2_crd_schemas_strictly(path, rendered, schemas):
    chart = rendered[path.name]
    for kind in ("TrainJob", "TrainingRuntime"):
        jsonschema.validate(chart.one(kind), schemas[kind])


def test_the_strict_schemas_catch_an_unknown_field(rendered, schemas):
    chart = rendered["cpu-values.yaml"]
    job = copy.deepcopy(chart.one("TrainJob"))
    job["spec"]["trainer"]["numProcsPerNode"] = 1
    with pytest.raises(jsonschema.ValidationError, match="numProcsPerNode"):
        jsonschema.validate(job, schemas["TrainJob"])
    runtime = copy.deepcopy(chart.one("TrainingRuntime"))
    runtime["spec"]["template"]["spec"]["failurePolicy"]["maxRestart"] = 1
    with pytest.raises(jsonschema.ValidationError, match="maxRestart"):
        jsonschema.validate(runtime, schemas["TrainingRuntime"])


@pytest.mark.parametrize("path", TRAINJOB_SCENARIOS, ids=[p.name for p in TRAINJOB_SCENARIOS])
def test_trainjob_meets_the_rules_of_trainer_jobset_and_the_job_api(path, rendered):
    chart = rendered[path.name]
    assert (
        trainjob_problems(chart.one("TrainJob"), chart.of_kind("TrainingRuntime"), kinds_in_order(chart))
        == []
    )


def test_the_rule_checker_catches_what_the_webhooks_reject(rendered):
    chart = rendered["cpu-values.yaml"]
    job, runtime = copy.deepcopy(chart.one("TrainJob")), copy.deepcopy(chart.one("TrainingRuntime"))
    job["metadata"]["name"] = "a" * 49  # its pods' names pass 63 characters
    job["spec"]["trainer"]["numProcPerNode"] = "auto"
    job["spec"]["trainer"]["env"] = [{"name": "PET_NNODES", "value": "2"}]
    node_job(runtime)["template"]["spec"]["template"]["spec"]["restartPolicy"] = (
        "OnFailure"  # with a podFailurePolicy
    )
    node_container(runtime)["ports"].append({"containerPort": 29500})
    runtime["spec"]["template"]["spec"]["ttlSecondsAfterFinished"] = 60
    order = ["TrainJob", "TrainingRuntime"]
    job["spec"]["runtimeRef"]["name"] = runtime["metadata"]["name"] = "a" * 49
    assert len(trainjob_problems(job, [runtime], order)) == 7
    assert trainjob_problems(job, [], order)[-1] == f"runtime TrainingRuntime/{'a' * 49} is not rendered"


@pytest.mark.parametrize("path", TRAINJOB_SCENARIOS, ids=[p.name for p in TRAINJOB_SCENARIOS])
def test_trainjob_and_runtime_round_trip_through_the_kubeflow_sdk_models(path, rendered):
    from kubeflow_trainer_api.models import TrainerV1alpha1TrainingRuntime, TrainerV1alpha1TrainJob

    chart = rendered[path.name]
    for kind, model in (
        ("TrainJob", TrainerV1alpha1TrainJob),
        ("TrainingRuntime", TrainerV1alpha1TrainingRuntime),
    ):
        item = chart.one(kind)
        assert model.from_dict(item).to_dict() == item


@pytest.mark.parametrize("path", TRAINJOB_SCENARIOS, ids=[p.name for p in TRAINJOB_SCENARIOS])
def test_the_runtimes_pod_template_passes_kubernetes_validate_strictly(path, rendered):
    template = node_job(rendered[path.name].one("TrainingRuntime"))["template"]["spec"]["template"]
    pod_template = {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": "node"},
        "template": template,
    }
    kubernetes_validate.validate(pod_template, K8S_VERSION, strict=True)


def test_the_runtime_is_created_before_the_trainjob_as_a_pre_install_hook(rendered):
    """Helm creates a release's unknown kinds alphabetically (TrainJob < TrainingRuntime) and
    Trainer's webhook refuses a TrainJob whose runtime does not exist: the runtime is a
    pre-install hook, first in what the chart renders, and re-created on each upgrade."""
    chart = rendered["cpu-values.yaml"]
    kinds = kinds_in_order(chart)
    assert kinds[0] == "TrainingRuntime" and kinds.index("TrainJob") > 0
    annotations = chart.one("TrainingRuntime")["metadata"]["annotations"]
    assert annotations["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert annotations["helm.sh/hook-delete-policy"] == "before-hook-creation"
    assert chart.manifest.index("kind: TrainingRuntime") < chart.manifest.index("kind: TrainJob")


def test_values_mean_the_same_in_both_kinds(rendered):
    """The GPU scenario as both kinds: the same pods, processes, image, resources, env,
    volumes and probes; only the operator-specific parts differ."""
    path = next(p for p in TRAINJOB_SCENARIOS if p.name == "gpu-16-s3-values.yaml")
    v2 = rendered[path.name]
    job, runtime = v2.one("TrainJob"), v2.one("TrainingRuntime")
    same_install = f"installId={job['metadata']['annotations']['ddp-trainer/install-id']}"  # as an upgrade
    v1 = render(merge_values(files=[path], sets=[same_install]), release="ddp-run", namespace="training")
    v1 = v1.one("PyTorchJob")
    worker = v1["spec"]["pytorchReplicaSpecs"]["Worker"]
    (pytorch,) = worker["template"]["spec"]["containers"]
    node = node_container(runtime)
    assert job["spec"]["trainer"]["numNodes"] == worker["replicas"] == 2
    assert job["spec"]["trainer"]["numProcPerNode"] == int(v1["spec"]["nprocPerNode"]) == 8
    assert job["spec"]["trainer"]["image"] == pytorch["image"] == node["image"]
    assert job["spec"]["trainer"]["resourcesPerNode"] == pytorch["resources"]
    assert node["env"] == pytorch["env"] and node["volumeMounts"] == pytorch["volumeMounts"]
    assert (
        node["livenessProbe"] == pytorch["livenessProbe"]
        and node["securityContext"] == pytorch["securityContext"]
    )
    v1_pod, v2_pod = worker["template"]["spec"], node_job(runtime)["template"]["spec"]["template"]["spec"]
    assert {k: v for k, v in v2_pod.items() if k not in ("containers", "restartPolicy")} == {
        k: v for k, v in v1_pod.items() if k != "containers"
    }
    # torchrun's c10d rendezvous at node 0 (the address Trainer gives), nodes fixed
    args = node["args"][node["args"].index("--") + 1 :]
    assert args[:2] == ["--rdzv-backend=c10d", "--rdzv-endpoint=$(PET_MASTER_ADDR):$(PET_MASTER_PORT)"]
    assert args[args.index("-m") :] == pytorch["args"][pytorch["args"].index("-m") :]


def test_exit_codes_keep_their_v1_meaning_in_the_pod_failure_policy(rendered):
    """ExitCode: 1-127 fail the job at once (a config error exits 2), 128-255 replace the
    pod, an evicted or preempted pod costs no retry; the JobSet fails at once on that
    permanent exit, and restarts whole up to trainJob.maxRestarts otherwise."""
    runtime = rendered["cpu-values.yaml"].one("TrainingRuntime")
    spec = node_job(runtime)["template"]["spec"]
    ignore, fail = spec["podFailurePolicy"]["rules"]
    assert ignore == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    excluded = set(fail["onExitCodes"]["values"])
    assert fail["action"] == "FailJob" and fail["onExitCodes"]["operator"] == "NotIn"
    assert [code for code in range(256) if code not in excluded] == list(range(1, 128))
    assert spec["template"]["spec"]["restartPolicy"] == "Never" and spec["backoffLimit"] == 6
    failure = runtime["spec"]["template"]["spec"]["failurePolicy"]
    assert failure["maxRestarts"] == 0
    notes = rendered["cpu-values.yaml"].notes
    assert "then the job fails: JobSet restarts it none (trainJob.maxRestarts 0)" in notes
    assert failure["rules"] == [
        {"name": "permanent-exit", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}
    ]
    on_failure = as_trainjob(TRAINJOB_SCENARIOS[0], "restartPolicy=OnFailure,trainJob.maxRestarts=2")
    spec = node_job(on_failure.one("TrainingRuntime"))["template"]["spec"]
    assert "podFailurePolicy" not in spec and spec["template"]["spec"]["restartPolicy"] == "OnFailure"
    assert on_failure.one("TrainingRuntime")["spec"]["template"]["spec"]["failurePolicy"]["maxRestarts"] == 2
    assert "JobSet restarts the whole job up to 2 times (trainJob.maxRestarts)" in on_failure.notes


def test_kueue_gang_and_deadline_reach_the_trainjob_and_its_runtime():
    path = next(p for p in SCENARIOS if p.name == "irsa-kueue-gang-values.yaml")
    chart = as_trainjob(
        path, "elastic.minNodes=0,elastic.maxNodes=0,gang.queue=,runPolicy.ttlSecondsAfterFinished=null"
    )
    job, runtime = chart.one("TrainJob"), chart.one("TrainingRuntime")
    assert (
        job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
        and job["spec"]["suspend"] is True
    )
    assert job["spec"]["activeDeadlineSeconds"] == 172800
    assert runtime["spec"]["podGroupPolicy"] == {"coscheduling": {"scheduleTimeoutSeconds": 600}}
    assert node_job(runtime)["template"]["spec"]["template"]["spec"]["priorityClassName"] == "training-high"
    assert trainjob_problems(job, [runtime], kinds_in_order(chart)) == []


@pytest.mark.parametrize(
    ("sets", "names"),
    [
        (
            "gpus=16,elastic.minNodes=1",
            "elastic.minNodes=1, elastic.maxNodes=0: a TrainJob trains on a fixed 2 pods",
        ),
        ("runPolicy.ttlSecondsAfterFinished=60", "runPolicy.ttlSecondsAfterFinished: not for a TrainJob"),
        ("runPolicy.cleanPodPolicy=None", "runPolicy.cleanPodPolicy=None: a TrainJob has no such policy"),
        ("restartPolicy=Always", "restartPolicy=Always: a TrainJob's pods belong to a Job"),
        ("gang.enabled=true,gang.queue=q", "gang.queue, gang.priorityClass: a TrainJob's gang"),
        (
            "trainer.extraEnv[0].name=PET_NODE_RANK,trainer.extraEnv[0].value=1",
            "trainer.extraEnv PET_NODE_RANK",
        ),
        ("fullnameOverride=" + "a" * 49, f'TrainJob name "{"a" * 49}" (49 characters)'),
    ],
)
def test_a_value_a_trainjob_cannot_take_is_refused_in_one_line(sets, names):
    with pytest.raises(HelmError) as refused:
        render(merge_values(sets=["jobKind=TrainJob", sets]))
    message = str(refused.value)
    assert names in message and "\n" not in message.strip()


def test_the_longest_name_a_trainjob_takes_renders():
    chart = render(merge_values(sets=["jobKind=TrainJob", "fullnameOverride=" + "a" * 48]))
    job = chart.one("TrainJob")
    assert len(f"{job['metadata']['name']}-node-0-0-abcde") == 63
    assert trainjob_problems(job, chart.of_kind("TrainingRuntime"), kinds_in_order(chart)) == []


def test_the_default_kind_renders_no_v2_objects():
    kinds = kinds_in_order(render(merge_values(sets=["gpus=8"])))
    assert "PyTorchJob" in kinds and not {"TrainJob", "TrainingRuntime"} & set(kinds)
