"""Each rule of Kubernetes' Job controller, JobSet v0.12.0 and Trainer v2.3.0 that `ddp-ops
local` follows for a TrainJob, table by table, with the file and line it comes from; and the
pods it plans for the chart's TrainJob: names, host names, injected environment, `$(VAR)`
expansion of the arguments."""

from __future__ import annotations

import pytest

from operator_scripts.chart.render import merge_values, render
from operator_scripts.controllers.job_rules import TrainJobRules, rules_for
from operator_scripts.controllers.jobset_status import (
    after_exit,
    job_failure,
    on_job_failure,
    replacement_delay,
)
from operator_scripts.controllers.pytorchjob_status import PodState
from operator_scripts.controllers.trainjob_env import plan_pods
from operator_scripts.local.pods import expand

EXIT_CODE_POLICY = {  # the chart's: restartPolicy ExitCode as training-operator v1 means it
    "rules": [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        {"action": "FailJob", "onExitCodes": {"containerName": "node", "operator": "NotIn",
                                               "values": [0, *range(128, 256)]}},
    ]
}  # fmt: skip
FAIL_ON_PERMANENT = {"maxRestarts": 2, "rules": [{"name": "p", "action": "FailJobSet",
                                                  "onJobFailureReasons": ["PodFailurePolicy"]}]}  # fmt: skip


def chart(*sets: str):
    return render(merge_values(sets=["jobKind=TrainJob", *sets]), release="ddp-run", namespace="training")


# pod_failure_policy.go matchPodFailurePolicy: first matching rule; OnFailure restarts in place
@pytest.mark.parametrize(
    ("restart_policy", "policy", "code", "action"),
    [
        ("Never", EXIT_CODE_POLICY, 0, "succeeded"),
        ("Never", EXIT_CODE_POLICY, 2, "fail-job"),  # a config error: permanent
        ("Never", EXIT_CODE_POLICY, 1, "fail-job"),
        ("Never", EXIT_CODE_POLICY, 137, "count"),  # SIGKILL: the pod is replaced, counted
        ("Never", EXIT_CODE_POLICY, 143, "count"),
        ("Never", None, 2, "count"),  # no policy: every failure counts
        ("OnFailure", None, 2, "restart"),
        ("Never", {"rules": [{"action": "Ignore", "onExitCodes": {"operator": "In", "values": [42]}}]}, 42,
         "ignore"),
        ("Never", {"rules": [{"action": "FailJob", "onExitCodes": {"containerName": "other", "operator": "In",
                                                                   "values": [2]}}]}, 2, "count"),
    ],
)  # fmt: skip
def test_a_node_pods_exit_meets_the_restart_and_pod_failure_policies(restart_policy, policy, code, action):
    assert after_exit(restart_policy, policy, code, "node") == action


def test_a_failed_pod_is_replaced_after_the_job_controllers_backoff():
    """backoff_utils.go getRemainingTimeForFailuresCount: 10 s doubling, capped at 600 s."""
    assert [replacement_delay(n) for n in (0, 1, 2, 3, 7, 20)] == [0.0, 10.0, 20.0, 40.0, 600.0, 600.0]


# job_controller.go syncJob: failed > backoffLimit; pastBackoffLimitOnFailure: restarts >= limit
@pytest.mark.parametrize(
    ("restart_policy", "limit", "failed", "restarts", "fails"),
    [
        ("Never", 6, 6, 0, False), ("Never", 6, 7, 0, True), ("Never", 0, 1, 0, True),
        ("OnFailure", 3, 0, 2, False), ("OnFailure", 3, 0, 3, True), ("OnFailure", 0, 0, 1, True),
        ("Never", 3, 0, 5, False),  # restarts count under OnFailure only
    ],
)  # fmt: skip
def test_the_node_job_fails_past_its_backoff_limit(restart_policy, limit, failed, restarts, fails):
    assert bool(job_failure(restart_policy, limit, failed, restarts)) == fails


# jobset failure_policy.go:49-85 (no policy fails; first matching rule; RestartJobSet by default),
# :225-232 (maxRestarts reached fails)
@pytest.mark.parametrize(
    ("policy", "reason", "counted", "verdict"),
    [
        (None, "BackoffLimitExceeded", 0, ("fail", "FailedJobs")),
        (FAIL_ON_PERMANENT, "PodFailurePolicy", 0, ("fail", "FailJobSetFailurePolicyAction")),
        (FAIL_ON_PERMANENT, "BackoffLimitExceeded", 1, ("restart", "")),
        ({"maxRestarts": 2}, "BackoffLimitExceeded", 2, ("fail", "ReachedMaxRestarts")),
        ({"maxRestarts": 0}, "BackoffLimitExceeded", 0, ("fail", "ReachedMaxRestarts")),
    ],
)  # fmt: skip
def test_the_jobset_fails_or_restarts_every_job_by_its_failure_policy(policy, reason, counted, verdict):
    result = on_job_failure(policy, reason, counted)
    assert (result.action, result.reason) == verdict


def test_the_chart_trainjobs_pods_names_hosts_and_environment():
    rendered = chart("gpus=0,cpuNodes=3,cpuProcsPerNode=2")
    pods = plan_pods(rendered.one("TrainJob"), rendered.one("TrainingRuntime"))
    assert [p.name for p in pods] == [f"ddp-run-ddp-trainer-node-0-{i}" for i in range(3)]
    assert pods[2].aliases == ("ddp-run-ddp-trainer-node-0-2.ddp-run-ddp-trainer",)
    assert [p.is_rank0 for p in pods] == [True, False, False]
    assert pods[2].env == {
        "PET_NNODES": "3",
        "PET_NPROC_PER_NODE": "2",
        "PET_NODE_RANK": "2",
        "PET_MASTER_ADDR": "ddp-run-ddp-trainer-node-0-0.ddp-run-ddp-trainer",
        "PET_MASTER_PORT": "29500",
        "JOB_COMPLETION_INDEX": "2",
    }
    assert pods[0].labels["batch.kubernetes.io/job-completion-index"] == "0"
    assert pods[0].container["name"] == "node" and pods[0].restart_policy == "Never"
    # the TrainJob's trainer reaches the container: image, resourcesPerNode merged
    trainer = rendered.one("TrainJob")["spec"]["trainer"]
    assert pods[0].container["image"] == trainer["image"]
    assert pods[0].container["resources"] == trainer["resourcesPerNode"]


def test_container_arguments_expand_variable_references_as_the_kubelet_does():
    env = {"PET_MASTER_ADDR": "tj-node-0-0.tj", "PET_MASTER_PORT": "29500"}
    assert (
        expand("--rdzv-endpoint=$(PET_MASTER_ADDR):$(PET_MASTER_PORT)", env)
        == "--rdzv-endpoint=tj-node-0-0.tj:29500"
    )
    assert expand("$(UNSET) costs $$5", env) == "$(UNSET) costs $5"


def test_a_pod_killed_past_the_backoff_limit_restarts_the_whole_jobset_then_fails_at_max_restarts():
    rendered = chart("runPolicy.backoffLimit=1,trainJob.maxRestarts=1")
    rules = rules_for(rendered.objects)
    assert isinstance(rules, TrainJobRules)
    pod = PodState("ddp-run-ddp-trainer-node-0-0", "node", "Running")
    first = rules.on_exit(pod, 137, [pod])
    assert (first.action, first.delay) == ("recreate", 10.0)
    second = rules.on_exit(pod, 137, [pod])  # failed 2 > backoffLimit 1: the Job fails
    assert second.action == "restart-all" and (rules.jobset_restarts, rules.failed) == (1, 0)
    rules.on_exit(pod, 137, [pod])
    last = rules.on_exit(pod, 137, [pod])
    assert last.action == "failed" and last.reason.startswith("ReachedMaxRestarts: ")
    config_error = rules_for(rendered.objects).on_exit(pod, 2, [pod])
    assert config_error.action == "failed" and config_error.reason.startswith(
        "FailJobSetFailurePolicyAction: "
    )


def test_a_trainjob_without_its_runtime_is_refused():
    objects = [o for o in chart().objects if o["kind"] != "TrainingRuntime"]
    with pytest.raises(
        ValueError, match="runtime TrainingRuntime/ddp-run-ddp-trainer is not among the objects"
    ):
        rules_for(objects)
