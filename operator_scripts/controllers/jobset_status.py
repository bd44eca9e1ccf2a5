"""How Kubernetes' Job controller, JobSet v0.12.0 and Kubeflow Trainer v2.3.0 decide a
TrainJob's fate: what becomes of a node pod whose container exits (restartPolicy and the
Job's podFailurePolicy), when the node Job fails (backoffLimit), what the JobSet's
failurePolicy does then (fail, or restart every Job against maxRestarts), and the TrainJob
condition that results. Pure functions, shared by `ddp-ops local` and its tests.
References: kubernetes pkg/controller/job/ (job_controller.go, pod_failure_policy.go,
backoff_utils.go), jobset pkg/controllers/ at v0.12.0, trainer at v2.3.0."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

PodAction = Literal["restart", "succeeded", "fail-job", "ignore", "count"]

# job_controller.go:76-79: DefaultJobPodFailureBackOff, MaxJobPodFailureBackOff
POD_FAILURE_BACKOFF_S, MAX_POD_FAILURE_BACKOFF_S = 10.0, 600.0
# jobset pkg/constants/constants.go:51-62,109
FAIL_JOBSET_REASON, MAX_RESTARTS_REASON = "FailJobSetFailurePolicyAction", "ReachedMaxRestarts"
FAILED_JOBS_REASON, COMPLETED_REASON = "FailedJobs", "AllJobsCompleted"


def after_exit(
    restart_policy: str, pod_failure_policy: dict[str, Any] | None, code: int, container: str
) -> PodAction:
    """What becomes of a node pod whose `container` exited with `code`. OnFailure: the
    kubelet restarts the container in place. Never: the pod ends Succeeded or Failed, and
    a failed pod meets the podFailurePolicy, first matching rule wins (pod_failure_policy.go
    matchPodFailurePolicy): FailJob fails the Job at once, Ignore replaces the pod without
    counting it, Count (and no match) counts it against backoffLimit. Only onExitCodes
    rules can match an exit: a pod deleted by a controller (an eviction) carries the
    DisruptionTarget condition instead, which `after_disruption` judges."""
    if code == 0:
        return "succeeded"
    if restart_policy == "OnFailure":
        return "restart"
    for rule in (pod_failure_policy or {}).get("rules", []):
        codes = rule.get("onExitCodes")
        if codes is None or codes.get("containerName") not in (None, container):
            continue
        listed = code in codes["values"]
        if listed == (codes["operator"] == "In"):
            return {"FailJob": "fail-job", "Ignore": "ignore"}.get(rule["action"], "count")
    return "count"


def after_disruption(pod_failure_policy: dict[str, Any] | None) -> PodAction:
    """What becomes of a node pod that a controller deleted (the taint manager's eviction,
    PodGC's force-deletion): it carries the DisruptionTarget condition, and the first
    podFailurePolicy rule on that condition decides; no such rule counts it."""
    for rule in (pod_failure_policy or {}).get("rules", []):
        conditions = rule.get("onPodConditions") or []
        if any(c.get("type") == "DisruptionTarget" and c.get("status", "True") == "True" for c in conditions):
            return {"FailJob": "fail-job", "Ignore": "ignore"}.get(rule["action"], "count")
    return "count"


def replacement_delay(failures_after_last_success: int) -> float:
    """Seconds before the Job controller creates the pod that replaces a failed one: 10 s,
    doubling per failure since the last success, at most 600 s
    (backoff_utils.go getRemainingTimeForFailuresCount)."""
    if failures_after_last_success <= 0:
        return 0.0
    return min(MAX_POD_FAILURE_BACKOFF_S, POD_FAILURE_BACKOFF_S * 2 ** (failures_after_last_success - 1))


def job_failure(restart_policy: str, backoff_limit: int, failed_pods: int, active_restarts: int) -> str:
    """The node Job's failure reason, or "": failed pods past backoffLimit
    (job_controller.go syncJob: `failed > backoffLimit`), or, under OnFailure, the container
    restarts of its active pods reaching it (pastBackoffLimitOnFailure: `>=`, any restart
    when the limit is 0)."""
    if failed_pods > backoff_limit:
        return "BackoffLimitExceeded"
    if restart_policy == "OnFailure" and (
        active_restarts > 0 if backoff_limit == 0 else active_restarts >= backoff_limit
    ):
        return "BackoffLimitExceeded"
    return ""


@dataclass(frozen=True)
class JobSetVerdict:
    """What the JobSet does about a failed child Job: restart every Job, or fail."""

    action: Literal["restart", "fail"]
    reason: str = ""
    counted: bool = True  # whether the restart counts against maxRestarts


def on_job_failure(
    failure_policy: dict[str, Any] | None, job_reason: str, restarts_counted: int
) -> JobSetVerdict:
    """JobSet's executeFailurePolicy (failure_policy.go:49-85): no policy fails the JobSet
    (FailedJobs); else the first rule whose onJobFailureReasons match (ruleIsApplicable,
    :142-165) acts, or RestartJobSet by default (:45); a restart counted when
    restartsCountTowardsMax has reached maxRestarts fails it instead (:225-232)."""
    if failure_policy is None:
        return JobSetVerdict("fail", FAILED_JOBS_REASON)
    action = "RestartJobSet"
    for rule in failure_policy.get("rules", []):
        if not rule.get("onJobFailureReasons") or job_reason in rule["onJobFailureReasons"]:
            action = rule["action"]
            break
    if action == "FailJobSet":
        return JobSetVerdict("fail", FAIL_JOBSET_REASON)
    counted = action == "RestartJobSet"
    if counted and restarts_counted >= int(failure_policy.get("maxRestarts", 0)):
        return JobSetVerdict("fail", MAX_RESTARTS_REASON)
    return JobSetVerdict("restart", counted=counted)
