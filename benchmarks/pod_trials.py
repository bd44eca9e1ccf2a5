"""The frozen-pod trial of `benchmarks.fault_trials`: the chart's two-pod CPU job (one
rank per pod) under `ddp-ops local`, whose second pod has every process SIGSTOPped after
a chosen step, as a frozen node would. Its ddp-launch cannot answer /healthz, the kubelet's
liveness probe (every 2 s, 2 s timeout, 3 failures) fails, the kubelet kills the container
(SIGTERM, then SIGKILL after the probe's 2 s grace period), the operator re-creates the pod (137)
with an empty /dev/shm, and the job resumes from the first pod's snapshot."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from benchmarks.trial_record import Timeline, Trial, final_state, same_state
from operator_scripts.chart.render import merge_values, render
from operator_scripts.local.kubelet import freeze_pod
from operator_scripts.local.run import run
from operator_scripts.paths import CHART_DIR

PROBES = (
    "liveness.periodSeconds=2,liveness.timeoutSeconds=2,liveness.failureThreshold=3,"
    "liveness.terminationGracePeriodSeconds=2,metrics.port=0,checkpoint.existingClaim=checkpoints"
)
TRAINER = (
    "trainer.config.model.dropout=0.3,trainer.config.checkpoint.every_steps=1000,"
    "trainer.config.log.every_steps=1,trainer.config.log.format=json,trainer.config.train.max_steps=120,"
    "trainer.config.checkpoint.snapshot_every_steps={every}"
)


def job_objects(every: int) -> list[dict[str, Any]]:
    cpu_pods = CHART_DIR / "ci" / "cpu-values.yaml"
    values = merge_values(files=[cpu_pods], sets=[PROBES, TRAINER.format(every=every)])
    return render(values, release="trial", namespace="trials").objects


def job_final_state(workdir: Path) -> dict:
    """The final state in the job's claim (its folder is named for the release)."""
    (latest,) = (workdir / "pvc" / "checkpoints").rglob("latest.json")
    return final_state(latest.parent)


def reference_job_state(workdir: Path, every: int) -> dict:
    """The job run once without a fault: the state every trial must end with."""
    outcome = run(job_objects(every), workdir / "reference", timeout=300, stream=None, notify=lambda _: None)
    if outcome.status != "Succeeded":
        raise RuntimeError(f"the reference job did not succeed: {outcome.summary()}")
    return job_final_state(workdir / "reference")


def freeze_trial(workdir: Path, fault_after: int, every: int, reference: dict) -> Trial:
    timeline = Timeline(fault_after)  # the job's start is the cold start it is held to
    pods_now: list = []

    def read(line: str) -> None:  # rank 0's log, streamed as `kubectl logs -f` would
        if not line.startswith("{"):
            return
        record = json.loads(line)
        if timeline.due(record) and pods_now:
            freeze_pod(pods_now[1])  # every process of the pod
            timeline.faulted(record["step"])
        timeline.read(record)

    def keep(pods: list) -> None:
        pods_now[:] = pods

    def note(line: str) -> None:
        if "liveness probes failed" in line and timeline.detected_at is None:
            timeline.detected_at = time.monotonic()

    outcome = run(
        job_objects(every),
        workdir,
        timeout=300,
        stream=read,
        notify=note,
        on_tick=keep,
    )
    identical = outcome.status == "Succeeded" and same_state(job_final_state(workdir), reference)
    resumed = timeline.resumed
    return Trial(
        "freeze",
        1,
        timeline.seen,
        resumed and resumed["resumed_from"],
        resumed and resumed["resume_origin"],
        resumed and resumed["lost_steps"],
        identical,
        timeline.since_fault(timeline.detected_at),
        timeline.since_fault(timeline.training_at),
        timeline.hangs,
        timeline.cold_s,
    )
