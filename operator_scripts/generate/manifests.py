"""k8s/: the chart rendered with k8s/reference-values.yaml, one file per template, for
kubectl users (`kubectl apply -k k8s/base`, or the TrainJob overlay)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from operator_scripts.chart.render import RenderedChart, merge_values, render
from operator_scripts.paths import REPO
from trainer.config.overrides import deep_merge

K8S_BASE = REPO / "k8s" / "base"
K8S_TRAINJOB = REPO / "k8s" / "overlays" / "trainjob"
K8S_REFERENCE = REPO / "k8s" / "reference-values.yaml"
K8S_RELEASE, K8S_NAMESPACE = "ddp-run", "training"
GENERATED_HEADER = "# Generated from the chart by `python -m operator_scripts.generate write`; do not edit.\n"
TRAINJOB_KUSTOMIZATION = """\
# The reference job as a Kubeflow Trainer v2 TrainJob (what `--set jobKind=TrainJob` renders),
# for kubectl users: kubectl apply -k k8s/overlays/trainjob
# In order (fifo): Trainer's webhook refuses a TrainJob whose runtime does not exist yet.
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
sortOptions:
  order: fifo
resources:
  - ../../base
  - trainingruntime.yaml
  - trainjob.yaml
patches:
  - target:
      group: kubeflow.org
      version: v1
      kind: PyTorchJob
      name: {name}
    patch: |-
      $patch: delete
      apiVersion: kubeflow.org/v1
      kind: PyTorchJob
      metadata:
        name: {name}
"""


def template_files(rendered: RenderedChart) -> dict[str, str]:
    """Each template's rendered text as a generated file, by the template's name (`configmap`,
    `trainjob`, ...), without Helm's `---` and `# Source:` lines."""
    files = {}
    for document in rendered.manifest.split("\n---\n"):
        source = re.search(r"^# Source: [^/]+/templates/(\S+)\.yaml$", document, re.MULTILINE)
        if source:
            body = re.sub(r"^---\n|^# Source: .*\n", "", document.strip() + "\n", flags=re.MULTILINE)
            files[source[1]] = GENERATED_HEADER + body
    return files


def k8s_base_files() -> dict[Path, str]:
    """The chart rendered with k8s/reference-values.yaml, one file per template, plus the
    kustomization that lists them."""
    rendered = render(merge_values(files=[K8S_REFERENCE]), release=K8S_RELEASE, namespace=K8S_NAMESPACE)
    files = {K8S_BASE / f"{name}.yaml": text for name, text in template_files(rendered).items()}
    names = sorted(path.name for path in files)
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": names,
    }
    files[K8S_BASE / "kustomization.yaml"] = GENERATED_HEADER + yaml.safe_dump(kustomization, sort_keys=False)
    return files


def k8s_trainjob_files() -> dict[Path, str]:
    """k8s/overlays/trainjob: the base with its PyTorchJob swapped for the TrainJob and its
    runtime, rendered from the same reference values."""
    values = deep_merge(merge_values(files=[K8S_REFERENCE]), {"jobKind": "TrainJob"})
    rendered = render(values, release=K8S_RELEASE, namespace=K8S_NAMESPACE)
    templates = template_files(rendered)
    files = {K8S_TRAINJOB / f"{name}.yaml": templates[name] for name in ("trainingruntime", "trainjob")}
    name = rendered.one("TrainJob")["metadata"]["name"]
    files[K8S_TRAINJOB / "kustomization.yaml"] = GENERATED_HEADER + TRAINJOB_KUSTOMIZATION.format(name=name)
    return files
