"""How the Kubeflow Training Operator v1.9.4 and the kubelet decide a PyTorchJob's fate:
what happens to a pod whose container exits, when restarts exhaust `backoffLimit`, when the
job has succeeded, and which pods the clean-up deletes. Pure functions over pod states, so
that `ddp-ops local` and its tests share one statement of each rule. References are to
kubeflow/trainer at tag v1.9.4 and to kubernetes' kubelet."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Phase = Literal["Pending", "Running", "Succeeded", "Failed"]
ExitAction = Literal["restart", "recreate", "succeeded", "failed"]

# pkg/kubelet/kubelet.go: backOffPeriod = 10 s, maxContainerBackOff = 300 s
KUBELET_BACKOFF_S, KUBELET_MAX_BACKOFF_S = 10.0, 300.0


@dataclass(frozen=True)
class PodState:
    """What the operator reads of one pod: its replica type, phase, the pytorch
    container's restart count, and whether its last exit was a permanent failure."""

    name: str
    replica_type: str  # "master" or "worker"
    phase: Phase
    restarts: int = 0


@dataclass(frozen=True)
class JobCondition:
    """The job's condition after a reconcile: Running, then Succeeded (a PyTorchJob), Complete
    (a TrainJob) or Failed, and why."""

    status: Literal["Running", "Succeeded", "Complete", "Failed"]
    reason: str = ""


def is_retryable_exit_code(code: int) -> bool:
    """ExitCode policy: 1-127 are permanent, 128-255 retryable (pkg/util/train/train_util.go:24-26;
    pkg/apis/kubeflow.org/v1/common_types.go:183-188)."""
    return code >= 128


def after_exit(restart_policy: str, code: int) -> ExitAction:
    """What becomes of a pod whose pytorch container exited with `code`.

    OnFailure and Always are the kubelet's: the container restarts in the same pod (its
    emptyDirs survive), and its restartCount grows. ExitCode runs the pod with the kubelet's
    policy Never (pkg/core/pod.go:81-89); the operator then deletes a pod that failed with
    a retryable code and creates it anew: fresh emptyDirs, restartCount 0
    (pkg/controller.v1/common/pod.go:350-372)."""
    if restart_policy == "Always" or (restart_policy == "OnFailure" and code != 0):
        return "restart"
    if code == 0:
        return "succeeded"
    if restart_policy == "ExitCode" and is_retryable_exit_code(code):
        return "recreate"
    return "failed"


def restart_delay(restart_number: int) -> float:
    """Seconds the kubelet waits before a container's n-th restart: the first at once, then
    10 s doubling up to 300 s (CrashLoopBackOff; pkg/kubelet/kubelet.go backOffPeriod,
    maxContainerBackOff; kuberuntime_manager.go doBackOff)."""
    if restart_number <= 1:
        return 0.0
    return min(KUBELET_MAX_BACKOFF_S, KUBELET_BACKOFF_S * 2 ** (restart_number - 2))


def counted_restarts(pods: list[PodState]) -> int:
    """Container restarts summed over the job's Running pods: what backoffLimit is compared
    with (pkg/core/job.go:95-132). A Pending pod's restarts do not count, and neither do
    ExitCode re-creations: each new pod starts at restartCount 0."""
    return sum(pod.restarts for pod in pods if pod.phase == "Running")


def past_backoff_limit(backoff_limit: int | None, pods: list[PodState], *, new_failure: bool) -> bool:
    """pkg/core/job.go:95-132 and pkg/controller.v1/common/job.go:190-201: no limit when unset;
    limit 0 fails on any restart or on a pod that newly failed (the work queue's requeue count
    the second test uses is always 0 in v1.9.4: pkg/common/util/fake_workqueue.go:55-56);
    otherwise the counted restarts reaching the limit fail the job."""
    if backoff_limit is None:
        return False
    restarts = counted_restarts(pods)
    if backoff_limit == 0:
        return restarts > 0 or new_failure
    return restarts >= backoff_limit


def job_condition(
    job: dict[str, Any], pods: list[PodState], *, permanent_failure: str = "", new_failure: bool = False
) -> JobCondition:
    """The condition the operator sets, checked in its order: the backoff limit
    (common/job.go:190-229), a permanent ExitCode failure (common/pod.go:367-372), then
    success: with a Master when the Master succeeded; Worker-only when every worker
    succeeded, or in elastic mode as soon as ANY worker did (pytorchjob_controller.go:386-435).
    A Never pod that failed fails the job (pytorchjob_controller.go:437-452)."""
    spec = job["spec"]
    limit = spec.get("runPolicy", {}).get("backoffLimit")
    if past_backoff_limit(limit, pods, new_failure=new_failure):
        return JobCondition("Failed", "BackoffLimitExceeded")
    if permanent_failure:
        return JobCondition("Failed", permanent_failure)
    replicas = spec["pytorchReplicaSpecs"]
    if "Master" in replicas:
        decisive = [pod for pod in pods if pod.replica_type == "master"]
        if decisive and all(pod.phase == "Succeeded" for pod in decisive):
            return JobCondition("Succeeded")
    else:
        workers = [pod for pod in pods if pod.replica_type == "worker"]
        done = [pod for pod in workers if pod.phase == "Succeeded"]
        if workers and (len(done) == len(workers) or (spec.get("elasticPolicy") is not None and done)):
            return JobCondition("Succeeded")
    return JobCondition("Running")


def pods_to_delete(clean_pod_policy: str, pods: list[PodState]) -> list[str]:
    """The pods a finished job's clean-up deletes (pkg/controller.v1/common/job.go:45-62):
    None keeps every pod, running ones included (they keep their GPUs and, under OnFailure,
    keep restarting); Running deletes Running and Pending pods and keeps finished ones with
    their logs; All deletes every pod."""
    if clean_pod_policy == "None":
        return []
    if clean_pod_policy == "Running":
        return [pod.name for pod in pods if pod.phase in ("Running", "Pending")]
    return [pod.name for pod in pods]
