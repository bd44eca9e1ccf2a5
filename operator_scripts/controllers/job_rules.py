"""The controller `ddp-ops local` plays, for each kind the chart renders: training-operator
v1.9.4 for a PyTorchJob (`pytorchjob_env`, `pytorchjob_status`), Kubernetes' Job controller with
JobSet v0.12.0 and Trainer v2.3.0 for a TrainJob (`trainjob_env`, `jobset_status`). Each
answers the same questions of the run loop in `local`: which pods, what a container's exit
does, the job's condition, which pods its end deletes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

from operator_scripts.controllers import jobset_status, pytorchjob_status, trainjob_env
from operator_scripts.controllers.pytorchjob_env import PodPlan, plan_pods, with_defaults
from operator_scripts.controllers.pytorchjob_status import JobCondition, PodState

Action = Literal["restart", "recreate", "succeeded", "failed", "restart-all"]


@dataclass(frozen=True)
class ExitOutcome:
    """What a container's exit leads to: the kubelet restarting it (after `delay`), its pod
    re-created (after `delay`), the pod done, the job failed (`reason`), or every pod of
    the job re-created (a JobSet restart)."""

    action: Action
    message: str
    delay: float = 0.0
    reason: str = ""


class JobRules(Protocol):
    kind: str
    name: str
    backoff_limit: int | None
    jobset_restarts: int

    def plans(self) -> list[PodPlan]: ...
    def on_exit(self, pod: PodState, code: int, pods: list[PodState]) -> ExitOutcome: ...
    def on_deleted(self, pod: PodState, why: str) -> ExitOutcome: ...
    def condition(self, pods: list[PodState], failure: str) -> JobCondition: ...
    def counted_restarts(self, pods: list[PodState]) -> int: ...
    def to_delete(self, pods: list[PodState]) -> tuple[list[str], str]: ...


def rules_for(objects: list[dict[str, Any]]) -> JobRules:
    """The rules for the one job among the rendered objects."""
    jobs = [item for item in objects if item.get("kind") in ("PyTorchJob", "TrainJob")]
    if len(jobs) != 1:
        raise ValueError(f"expected one PyTorchJob or TrainJob among the objects, found {len(jobs)}")
    if jobs[0]["kind"] == "PyTorchJob":
        return PyTorchJobRules(jobs[0])
    ref = jobs[0]["spec"]["runtimeRef"]
    kind = ref.get("kind", "ClusterTrainingRuntime")
    runtimes = [o for o in objects if o.get("kind") == kind and o["metadata"]["name"] == ref["name"]]
    if not runtimes:  # Trainer's webhook: pkg/runtime/core/trainingruntime.go:305-313
        raise ValueError(f"the TrainJob's runtime {kind}/{ref['name']} is not among the objects")
    return TrainJobRules(jobs[0], runtimes[0])


class PyTorchJobRules:
    """training-operator v1.9.4 and the kubelet (pytorchjob_status)."""

    kind = "PyTorchJob"
    jobset_restarts = 0

    def __init__(self, job: dict[str, Any]) -> None:
        self.job = with_defaults(job)
        self.name = self.job["metadata"]["name"]
        self.run_policy = self.job["spec"]["runPolicy"]
        self.backoff_limit = self.run_policy.get("backoffLimit")

    def plans(self) -> list[PodPlan]:
        return plan_pods(self.job)

    def on_exit(self, pod: PodState, code: int, pods: list[PodState]) -> ExitOutcome:
        policy = self.job["spec"]["pytorchReplicaSpecs"][pod.replica_type.capitalize()]["restartPolicy"]
        action = pytorchjob_status.after_exit(policy, code)
        exited = f"pod {pod.name} exited with code {code}"
        if action == "restart":
            delay = pytorchjob_status.restart_delay(pod.restarts + 1)
            return ExitOutcome("restart", f"{exited}; restart {pod.restarts + 1} in {delay:.0f}s", delay)
        if action == "recreate":
            return ExitOutcome("recreate", f"{exited} (retryable); the operator re-creates it")
        if action == "succeeded":
            return ExitOutcome("succeeded", "")
        reason = exited + (", not retryable" if policy == "ExitCode" else "")
        return ExitOutcome("failed", f"pod {pod.name} failed with exit code {code}", reason=reason)

    def on_deleted(self, pod: PodState, why: str) -> ExitOutcome:
        """A pod deleted under the operator (evicted, force-deleted): no pod of its index
        exists any more, so the operator creates it anew (pkg/controller.v1/common/pod.go
        ReconcilePods, `len(podSlice) == 0`); no restart is counted."""
        return ExitOutcome("recreate", f"pod {pod.name} deleted ({why}); the operator creates it anew")

    def condition(self, pods: list[PodState], failure: str) -> JobCondition:
        return pytorchjob_status.job_condition(
            self.job, pods, permanent_failure=failure, new_failure=bool(failure)
        )

    def counted_restarts(self, pods: list[PodState]) -> int:
        return pytorchjob_status.counted_restarts(pods)

    def to_delete(self, pods: list[PodState]) -> tuple[list[str], str]:
        policy = self.run_policy["cleanPodPolicy"]
        return pytorchjob_status.pods_to_delete(policy, pods), f"cleanPodPolicy {policy}"


class TrainJobRules:
    """Kubernetes' Job controller for the runtime's Indexed node Job, JobSet's failure policy
    over it, and the conditions Trainer copies onto the TrainJob (jobset_status)."""

    kind = "TrainJob"

    def __init__(self, trainjob: dict[str, Any], runtime: dict[str, Any]) -> None:
        self.trainjob, self.runtime = trainjob, runtime
        self.node_job = trainjob_env.node_job(trainjob, runtime)
        self.name = self.node_job.name
        self.backoff_limit = self.node_job.backoff_limit
        self.failed = 0  # the node Job's status.failed: failed pods not ignored
        self.failures_since_success = 0  # the Job controller's backoff record
        self.jobset_restarts = 0  # status.restarts of the JobSet
        self.restarts_counted = 0  # status.restartsCountTowardsMax

    def plans(self) -> list[PodPlan]:
        return trainjob_env.plan_pods(self.trainjob, self.runtime)

    def on_exit(self, pod: PodState, code: int, pods: list[PodState]) -> ExitOutcome:
        job, exited = self.node_job, f"pod {pod.name} exited with code {code}"
        action = jobset_status.after_exit(job.restart_policy, job.pod_failure_policy, code, trainjob_env.NODE)
        if action == "succeeded":
            self.failures_since_success = 0
            return ExitOutcome("succeeded", "")
        if action == "restart":  # OnFailure: the kubelet's restart, counted by the Job
            delay = pytorchjob_status.restart_delay(pod.restarts + 1)
            active = _active_restarts(pods) + 1  # with this one
            if reason := jobset_status.job_failure(
                job.restart_policy, job.backoff_limit, self.failed, active
            ):
                return self._job_failed(reason, exited)
            return ExitOutcome("restart", f"{exited}; restart {pod.restarts + 1} in {delay:.0f}s", delay)
        if action == "fail-job":
            return self._job_failed("PodFailurePolicy", f"{exited} (podFailurePolicy: FailJob)")
        return self._replace(action, exited)

    def on_deleted(self, pod: PodState, why: str) -> ExitOutcome:
        """A node pod a controller deleted carries DisruptionTarget; the Job's
        podFailurePolicy decides whether its replacement counts (jobset_status.after_disruption)."""
        deleted = f"pod {pod.name} deleted ({why}, DisruptionTarget)"
        action = jobset_status.after_disruption(self.node_job.pod_failure_policy)
        if action == "fail-job":
            return self._job_failed("PodFailurePolicy", f"{deleted} (podFailurePolicy: FailJob)")
        return self._replace(action, deleted)

    def _replace(self, action: str, what: str) -> ExitOutcome:
        """A failed pod the Job replaces, counted against backoffLimit unless ignored."""
        job = self.node_job
        self.failures_since_success += 1
        counted = "not counted (podFailurePolicy: Ignore)"
        if action == "count":
            self.failed += 1
            counted = f"failed pod {self.failed}, backoffLimit {job.backoff_limit}"
            if reason := jobset_status.job_failure(job.restart_policy, job.backoff_limit, self.failed, 0):
                return self._job_failed(reason, f"{what} ({counted})")
        delay = jobset_status.replacement_delay(self.failures_since_success)
        return ExitOutcome("recreate", f"{what} ({counted}); the Job replaces it in {delay:.0f}s", delay)

    def _job_failed(self, job_reason: str, what: str) -> ExitOutcome:
        """The node Job failed: the JobSet fails, or re-creates every Job."""
        policy = self.node_job.failure_policy
        verdict = jobset_status.on_job_failure(policy, job_reason, self.restarts_counted)
        failed = f"{what}; the node Job failed ({job_reason})"
        if verdict.action == "fail":
            return ExitOutcome("failed", f"{failed}, so the JobSet did", reason=f"{verdict.reason}: {what}")
        self.jobset_restarts += 1
        self.restarts_counted += verdict.counted
        self.failed = self.failures_since_success = 0
        maximum = int(policy.get("maxRestarts", 0))
        return ExitOutcome(
            "restart-all",
            f"{failed}; JobSet restart {self.restarts_counted} of {maximum} re-creates every pod",
        )

    def condition(self, pods: list[PodState], failure: str) -> JobCondition:
        if failure:
            return JobCondition("Failed", failure)
        if pods and all(pod.phase == "Succeeded" for pod in pods):
            return JobCondition("Complete", jobset_status.COMPLETED_REASON)
        return JobCondition("Running")

    def counted_restarts(self, pods: list[PodState]) -> int:
        return self.failed + _active_restarts(pods)

    def to_delete(self, pods: list[PodState]) -> tuple[list[str], str]:
        """A finished JobSet deletes its active child Jobs (jobset_controller.go:162-166), whose
        running pods go; finished pods stay."""
        deleted = pytorchjob_status.pods_to_delete("Running", pods)
        return deleted, "the finished JobSet deletes its running Job"


def _active_restarts(pods: list[PodState]) -> int:
    """Container restarts of the Job's active pods (what OnFailure counts against backoffLimit)."""
    return sum(p.restarts for p in pods if p.phase in ("Running", "Pending"))
