"""The chart's CI scenarios (`helm/ci/*-values.yaml`) rendered as the tests read them."""

from __future__ import annotations

from pathlib import Path

from operator_scripts.chart.render import merge_values, render
from operator_scripts.paths import CHART_DIR

SCENARIOS = sorted((CHART_DIR / "ci").glob("*-values.yaml"))
K8S_VERSION = "1.30.0"


def scenario(path: Path):
    return render(merge_values(files=[path]), release="ddp-run", namespace="training")


def pod_templates(job: dict) -> dict[str, dict]:
    return {kind: spec["template"] for kind, spec in job["spec"]["pytorchReplicaSpecs"].items()}


def trainer_container(template: dict) -> dict:
    (container,) = [c for c in template["spec"]["containers"] if c["name"] == "pytorch"]
    return container
