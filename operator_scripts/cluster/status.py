"""`ddp-ops status`: a job's state in a few lines, from the job, its JobSet and its pods as
the API returns them (pure functions, tested on the controllers' own objects)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from operator_scripts.controllers.pytorchjob_env import LABEL
from operator_scripts.controllers.trainjob_env import INDEX_LABEL
from trainer.telemetry.trainer_status import trainer_status

NO_TRAINER_STATUS = (
    "none in status.trainerStatus yet (no progress line yet, or Trainer's TrainJobStatus gate is off)"
)
# rank 0's series (trainer/telemetry/metrics.py) -> the figure of a progress line
SERIES = {
    "ddp_train_step": "step",
    "ddp_train_total_steps": "total_steps",
    "ddp_train_eta_seconds": "eta_seconds",
    "ddp_train_loss": "loss",
    "ddp_train_global_samples_per_second": "samples_per_second",
    "ddp_checkpoint_last_success_step": "durable_step",
}


@dataclass(frozen=True)
class JobStatus:
    """What `status` prints."""

    name: str
    state: str
    conditions: list[tuple[str, str, str]]  # (type, status, reason or message)
    replicas: dict[str, dict[str, int]]
    restarts: int
    age_seconds: float | None
    rank0_pod: str | None
    kind: str = "PyTorchJob"
    jobset_restarts: int = 0
    failures: list[str] = field(default_factory=list)  # `failure_line` of each pod that failed last
    progress: dict[str, Any] | None = None  # as status.trainerStatus holds it
    progress_from: str = "status.trainerStatus"  # where it came from, or why there is none
    start: str | None = None  # `pod_start` of rank 0's pod


def failure_line(pod: str, exit_code: int, message: str) -> str:
    """A failed container as `kubectl describe pod` shows it, in one line: the pod, its exit
    code, and its termination message's last line (the trainer's one line, where it wrote one)."""
    said = message.strip().splitlines()
    return f"pod {pod}: exit {exit_code}: {said[-1] if said else '(no message)'}"


def pod_failures(pods: list[dict[str, Any]]) -> list[str]:
    """Each pod whose container ended non-zero, now or in its last run, with its message."""
    lines = []
    for pod in pods:
        for container in pod.get("status", {}).get("containerStatuses", []):
            for state in (container.get("state", {}), container.get("lastState", {})):
                ended = state.get("terminated") or {}
                if code := ended.get("exitCode"):
                    lines.append(failure_line(pod["metadata"]["name"], code, ended.get("message", "")))
                    break
    return lines


def _moment(text: str | None) -> datetime | None:
    """An API timestamp (RFC 3339, `Z` for UTC)."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")) if text else None


def _age(item: dict[str, Any], now: datetime | None) -> float | None:
    created = _moment(item["metadata"].get("creationTimestamp"))
    return ((now or datetime.now(timezone.utc)) - created).total_seconds() if created else None


def _container_restarts(pods: list[dict[str, Any]]) -> int:
    return sum(
        cs.get("restartCount", 0) for pod in pods for cs in pod.get("status", {}).get("containerStatuses", [])
    )


def summarize(job: dict[str, Any], pods: list[dict[str, Any]], now: datetime | None = None) -> JobStatus:
    """A job's state from its conditions (the newest true one), replica counts, container
    restarts and the pod labelled as rank 0's."""
    status = job.get("status", {})
    conditions = status.get("conditions", [])
    true = [c for c in conditions if c.get("status") == "True"]
    state = true[-1]["type"] if true else "Pending"
    age = _age(job, now)
    restarts = _container_restarts(pods)
    rank0 = [
        p["metadata"]["name"]
        for p in pods
        if p["metadata"].get("labels", {}).get(f"{LABEL}/job-role") == "master"
    ]
    return JobStatus(
        name=job["metadata"]["name"],
        state=state,
        conditions=[
            (c["type"], c.get("status", ""), c.get("reason") or c.get("message", "")) for c in conditions
        ],
        replicas={kind: dict(counts) for kind, counts in status.get("replicaStatuses", {}).items()},
        restarts=restarts,
        age_seconds=age,
        rank0_pod=rank0[0] if rank0 else None,
        failures=pod_failures(pods),
        start=next((pod_start(p) for p in pods if p["metadata"]["name"] in rank0[:1]), None),
    )


def summarize_trainjob(
    trainjob: dict[str, Any],
    jobset: dict[str, Any] | None,
    pods: list[dict[str, Any]],
    now: datetime | None = None,
) -> JobStatus:
    """A TrainJob's state: its own condition when it has one (only Suspended, Complete and
    Failed exist, trainjob_types.go:56-84), else Running or Pending from its pods; the
    JobSet's conditions beside its own, the per-job counts Trainer mirrors
    (status.jobsStatus), container restarts, the JobSet's whole restarts, and rank 0's pod
    (completion index 0, the newest)."""
    conditions = list(trainjob.get("status", {}).get("conditions", []))
    true = [c["type"] for c in conditions if c.get("status") == "True"]
    running = any(p.get("status", {}).get("phase") == "Running" for p in pods)
    state = true[-1] if true else "Running" if running else "Pending"
    jobset_status = (jobset or {}).get("status", {})
    listed = [(c["type"], c.get("status", ""), c.get("reason") or c.get("message", "")) for c in conditions]
    listed += [
        (f"JobSet {c['type']}", c.get("status", ""), c.get("reason") or c.get("message", ""))
        for c in jobset_status.get("conditions", [])
    ]
    counts = {
        f"job {job['name']}": {
            key: int(job.get(key) or 0) for key in ("active", "ready", "succeeded", "failed")
        }
        for job in trainjob.get("status", {}).get("jobsStatus", [])
    }
    trainer_said = trainjob.get("status", {}).get("trainerStatus")
    rank0 = sorted(
        (p for p in pods if p["metadata"].get("labels", {}).get(INDEX_LABEL) == "0"),
        key=lambda p: p["metadata"].get("creationTimestamp", ""),
    )
    return JobStatus(
        name=trainjob["metadata"]["name"],
        state=state,
        conditions=listed,
        replicas=counts,
        restarts=_container_restarts(pods),
        age_seconds=_age(trainjob, now),
        rank0_pod=rank0[-1]["metadata"]["name"] if rank0 else None,
        start=pod_start(rank0[-1]) if rank0 else None,
        kind="TrainJob",
        jobset_restarts=int(jobset_status.get("restarts", 0)),
        failures=pod_failures(pods),
        progress=trainer_said,
        progress_from=trainer_status_source(trainer_said),
    )


def trainer_status_source(trainer_said: dict[str, Any] | None) -> str:
    """Where a TrainJob's progress lines come from, or why there are none."""
    return "status.trainerStatus" if trainer_said else NO_TRAINER_STATUS


def rank0_figures(text: str) -> dict[str, float]:
    """Rank 0's figures in a pod's metrics page (Prometheus' text format); none where rank 0
    does not run in that pod."""
    from prometheus_client.parser import text_string_to_metric_families

    figures: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in SERIES and sample.labels.get("rank") == "0":
                figures[SERIES[sample.name]] = sample.value
    return figures


def progress_from_metrics(figures: dict[str, float], now: datetime | None = None) -> dict[str, Any] | None:
    """A trainerStatus made of rank 0's figures, as the trainer would post them; None
    before rank 0's first progress line."""
    if not figures.get("total_steps"):
        return None
    figures = {k: v for k, v in figures.items() if k != "durable_step" or v}  # zero: no checkpoint yet
    return trainer_status(figures, now or datetime.now(timezone.utc))["trainerStatus"]


def pod_start(pod: dict[str, Any]) -> str | None:
    """The start of a pod before its trainer's own split: created to scheduled (the
    PodScheduled condition's transition), scheduled to its trainer container's start
    (volumes, the sandbox and the image pull: containerStatuses[].state.running.startedAt);
    None until the container runs."""
    status = pod.get("status", {})
    created = _moment(pod["metadata"].get("creationTimestamp"))
    scheduled = next(
        (
            _moment(c.get("lastTransitionTime"))
            for c in status.get("conditions", [])
            if c["type"] == "PodScheduled"
        ),
        None,
    )
    started = next(
        (
            _moment(cs.get("state", {}).get("running", {}).get("startedAt"))
            for cs in status.get("containerStatuses", [])
        ),
        None,
    )
    if not (created and scheduled and started):
        return None
    waited, pulled = (scheduled - created).total_seconds(), (started - scheduled).total_seconds()
    return (
        f"  start of pod {pod['metadata']['name']}: scheduled in {waited:.0f}s, its container started "
        f"{pulled:.0f}s later (image pull, volumes); the trainer's own split is its `start-up` log line"
    )


def _clock(seconds: int) -> str:
    hours, rest = divmod(int(seconds), 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def progress_lines(progress: dict[str, Any] | None, source: str) -> list[str]:
    """Where the job is, in two lines: progress and ETA, then the figures and the newest
    durable step."""
    if not progress:
        return [f"  progress: {source}"]
    figures = {metric["name"]: metric["value"] for metric in progress.get("metrics", [])}
    percent = progress.get("progressPercentage")
    head = "  progress: " + ("unknown" if percent is None else f"{percent}%")
    if "step" in figures and "total_steps" in figures:
        head += f" (step {figures['step']} of {figures['total_steps']})"
    if (eta := progress.get("estimatedRemainingSeconds")) is not None:
        head += f", ETA {_clock(eta)}"
    head += f"; {source}, {progress.get('lastUpdatedTime', 'no time')}"
    said = [f"{name} {figures[name]}" for name in ("loss", "val_loss") if name in figures]
    if "samples_per_second" in figures:
        said.append(f"{figures['samples_per_second']} samples/s")
    durable = figures.get("durable_step")
    said.append(f"newest checkpoint step {durable}" if durable else "no checkpoint yet")
    return [head, "  " + ", ".join(said)]


def format_status(summary: JobStatus) -> str:
    age = (
        "unknown"
        if summary.age_seconds is None
        else f"{int(summary.age_seconds // 60)}m{int(summary.age_seconds % 60)}s"
    )
    restarts = f"container restarts {summary.restarts}"
    if summary.kind == "TrainJob":
        restarts += f", JobSet restarts {summary.jobset_restarts}"
    lines = [f"{summary.kind} {summary.name}: {summary.state} (age {age}, {restarts})"]
    for kind, counts in summary.replicas.items():
        lines.append(f"  {kind}: " + ", ".join(f"{key} {value}" for key, value in sorted(counts.items())))
    for kind, flag, why in summary.conditions:
        lines.append(f"  condition {kind}={flag} {why}".rstrip())
    lines.append(f"  rank 0 pod: {summary.rank0_pod or 'not scheduled yet'}")
    lines.extend([summary.start] if summary.start else [])
    lines.extend(progress_lines(summary.progress, summary.progress_from))
    lines.extend(f"  {line}" for line in summary.failures)
    return "\n".join(lines)
