"""Every file generated from code, and the folders whose files only the generator writes."""

from __future__ import annotations

from pathlib import Path

from operator_scripts.generate.manifests import K8S_BASE, K8S_TRAINJOB, k8s_base_files, k8s_trainjob_files
from operator_scripts.generate.monitoring import monitoring_files
from operator_scripts.generate.schema import schema_files
from operator_scripts.generate.values_table import docs_files


def generated_files() -> dict[Path, str]:
    return {
        **k8s_base_files(),
        **k8s_trainjob_files(),
        **docs_files(),
        **schema_files(),
        **monitoring_files(),
    }


def owned_files() -> list[Path]:
    """The files `write` may remove: a template the chart dropped leaves no stale manifest."""
    return sorted([*K8S_BASE.glob("*.yaml"), *K8S_TRAINJOB.glob("*.yaml")])
