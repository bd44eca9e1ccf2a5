"""Each rule of training-operator v1.9.4 and the kubelet that `ddp-ops local` follows, table
by table, with the file and line it comes from (kubeflow/trainer at tag v1.9.4)."""

from __future__ import annotations

import pytest

from operator_scripts.controllers.pytorchjob_env import injected_env, with_defaults
from operator_scripts.controllers.pytorchjob_status import (
    PodState,
    after_exit,
    job_condition,
    past_backoff_limit,
    pods_to_delete,
    restart_delay,
)


def bare_job(*, master: bool = False, workers: int = 2, elastic: dict | None = None, **spec) -> dict:
    """A PyTorchJob as a user might write it, without any field the operator defaults."""
    template = {"spec": {"containers": [{"name": "pytorch", "image": "trainer:1"}]}}
    replicas = {"Worker": {"replicas": workers, "template": template}}
    if master:
        replicas["Master"] = {"replicas": 1, "template": template}
    body = {"pytorchReplicaSpecs": replicas, **spec}
    if elastic is not None:
        body["elasticPolicy"] = elastic
    return {"metadata": {"name": "j"}, "spec": body}


# pkg/apis/kubeflow.org/v1/pytorch_defaults.go:38-56 (elastic bounds), :68-75 (nprocPerNode),
# :77-96 (cleanPodPolicy None, restartPolicy OnFailure)
@pytest.mark.parametrize(
    ("elastic", "bounds"),
    [
        ({}, (3, 3)), ({"maxReplicas": 5}, (5, 5)), ({"minReplicas": 2}, (2, 2)),
        ({"minReplicas": 1, "maxReplicas": 4}, (1, 4)),
    ],
)  # fmt: skip
def test_elastic_bounds_default_from_each_other_or_the_workers(elastic, bounds):
    job = bare_job(workers=3, elastic=elastic)
    defaulted = with_defaults(job)["spec"]["elasticPolicy"]
    assert (defaulted["minReplicas"], defaulted["maxReplicas"]) == bounds
    assert injected_env(job, "worker", 0)["PET_NNODES"] == f"{bounds[0]}:{bounds[1]}"


def test_run_policy_restart_policy_and_nproc_defaults():
    defaulted = with_defaults(bare_job())
    assert defaulted["spec"]["runPolicy"]["cleanPodPolicy"] == "None"
    assert defaulted["spec"]["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] == "OnFailure"
    assert defaulted["spec"]["nprocPerNode"] == "auto"
    deprecated = with_defaults(bare_job(elastic={"nProcPerNode": 4}))
    assert "nprocPerNode" not in deprecated["spec"]


# envvar.go:62-64,85-88,99-104,132-140 and elastic.go:87-91: nprocPerNode "auto" counts as 1
# in WORLD_SIZE; PET_NNODES is min:max on every replica type of an elastic job, a Master too
@pytest.mark.parametrize(
    ("job", "replica", "expected"),
    [
        (bare_job(master=True), "master", {"PET_NPROC_PER_NODE": "auto", "WORLD_SIZE": "3",
                                           "PET_NNODES": "3"}),
        (bare_job(master=True, nprocPerNode="4"), "worker", {"WORLD_SIZE": "12", "RANK": "2"}),
        (bare_job(master=True, elastic={"maxReplicas": 4}), "master", {"PET_NNODES": "4:4"}),
        (bare_job(elastic={}), "worker", {"PET_RDZV_ENDPOINT": "j-worker-0:23456",
                                          "PET_RDZV_BACKEND": "c10d"}),
    ],
)  # fmt: skip
def test_injected_environment(job, replica, expected):
    env = injected_env(job, replica, 1)
    assert expected.items() <= env.items()
    if "elasticPolicy" in job["spec"] and "Master" not in job["spec"]["pytorchReplicaSpecs"]:
        assert not {"MASTER_ADDR", "RANK", "WORLD_SIZE"} & env.keys()


# pkg/util/train/train_util.go:24-26 (retryable >= 128); pkg/core/pod.go:81-89 (ExitCode pods
# run with the kubelet's Never); pkg/controller.v1/common/pod.go:350-372 (re-create or fail)
@pytest.mark.parametrize(
    ("policy", "code", "action"),
    [
        ("OnFailure", 1, "restart"), ("OnFailure", 0, "succeeded"), ("Always", 0, "restart"),
        ("Never", 137, "failed"), ("Never", 0, "succeeded"),
        ("ExitCode", 2, "failed"), ("ExitCode", 127, "failed"), ("ExitCode", 128, "recreate"),
        ("ExitCode", 137, "recreate"), ("ExitCode", 143, "recreate"), ("ExitCode", 0, "succeeded"),
    ],
)  # fmt: skip
def test_what_becomes_of_a_pod_whose_container_exits(policy, code, action):
    assert after_exit(policy, code) == action


# pkg/kubelet/kubelet.go: backOffPeriod 10 s, maxContainerBackOff 300 s
@pytest.mark.parametrize(("restart", "delay"), [(1, 0), (2, 10), (3, 20), (4, 40), (7, 300), (20, 300)])
def test_kubelet_restart_back_off(restart, delay):
    assert restart_delay(restart) == delay


def running(name: str, phase: str = "Running", kind: str = "worker", restarts: int = 0) -> PodState:
    return PodState(name, kind, phase, restarts)  # type: ignore[arg-type]


# pkg/core/job.go:95-132 (sum over Running pods, >= limit, limit 0: > 0);
# common/job.go:190-201 with fake_workqueue.go:55-56 (limit 0 fails on a new pod failure)
@pytest.mark.parametrize(
    ("limit", "pods", "new_failure", "past"),
    [
        (None, [running("a", restarts=50)], False, False),
        (3, [running("a", restarts=1), running("b", restarts=1)], False, False),
        (3, [running("a", restarts=2), running("b", restarts=1)], False, True),
        (3, [running("a", restarts=2), running("b", "Pending", restarts=5)], False, False),
        (0, [running("a", restarts=0)], False, False),
        (0, [running("a", restarts=1)], False, True),
        (0, [running("a", restarts=0)], True, True),
        (2, [running("a", restarts=0)], True, False),
    ],
)  # fmt: skip
def test_backoff_limit_is_a_sum_of_restarts_over_running_pods(limit, pods, new_failure, past):
    assert past_backoff_limit(limit, pods, new_failure=new_failure) is past


# pytorchjob_controller.go:386-435: with a Master, the Master decides; Worker-only, all
# workers, or in elastic mode any worker
@pytest.mark.parametrize(
    ("job", "phases", "status"),
    [
        (bare_job(elastic={}), ["Succeeded", "Running"], "Succeeded"),
        (bare_job(), ["Succeeded", "Running"], "Running"),
        (bare_job(), ["Succeeded", "Succeeded"], "Succeeded"),
        (bare_job(master=True), ["Succeeded", "Running", "Running"], "Succeeded"),
        (bare_job(master=True), ["Running", "Succeeded", "Succeeded"], "Running"),
    ],
)  # fmt: skip
def test_when_the_job_succeeds(job, phases, status):
    kinds = ["master"] * (len(phases) - 2) + ["worker", "worker"]
    pods = [running(f"p{i}", phase, kind) for i, (phase, kind) in enumerate(zip(phases, kinds, strict=True))]
    assert job_condition(job, pods).status == status


def test_a_permanent_failure_or_the_backoff_limit_fails_the_job_first():
    job = bare_job(elastic={}, runPolicy={"backoffLimit": 2})
    pods = [running("a", restarts=2), running("b", phase="Succeeded")]
    condition = job_condition(job, pods)
    assert (condition.status, condition.reason) == ("Failed", "BackoffLimitExceeded")
    failed = job_condition(bare_job(elastic={}), [running("a")], permanent_failure="pod a exited with code 2")
    assert failed.status == "Failed" and "code 2" in failed.reason


# pkg/controller.v1/common/job.go:45-62
@pytest.mark.parametrize(
    ("policy", "deleted"), [("None", []), ("Running", ["a", "b"]), ("All", ["a", "b", "c"])]
)
def test_clean_pod_policy(policy, deleted):
    pods = [running("a"), running("b", phase="Pending"), running("c", phase="Succeeded")]
    assert pods_to_delete(policy, pods) == deleted
