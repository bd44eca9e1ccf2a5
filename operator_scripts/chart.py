"""The chart, rendered as `helm install --dry-run=client` would, with no helm binary:
helm-python-sdk runs Helm's own engine in-process (schema check, templates, NOTES)."""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter

from operator_scripts import generated
from trainer.config import Config, ConfigError, did_you_mean, from_tree
from trainer.config.overrides import deep_merge

CHART_DIR = Path(__file__).resolve().parents[1] / "helm"


@dataclass(frozen=True)
class RenderedChart:
    """The manifest as Helm prints it, its objects, and the NOTES text."""

    manifest: str
    objects: list[dict[str, Any]]
    notes: str

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [item for item in self.objects if item.get("kind") == kind]

    def one(self, kind: str) -> dict[str, Any]:
        (found,) = self.of_kind(kind)
        return found


def merge_values(files: Sequence[Path] = (), sets: Sequence[str] = ()) -> dict[str, Any]:
    """`-f FILE` then `--set EXPR` in order, with Helm's own parser for the latter."""
    from helm_python import parse_set_string

    merged: dict[str, Any] = {}
    for path in files:
        merged = deep_merge(merged, yaml.safe_load(Path(path).read_text()) or {})
    for expression in sets:
        merged = deep_merge(merged, parse_set_string(expression))
    return merged


class ValuesError(ValueError):
    """A chart value the trainer would refuse, said in the trainer's one line."""


def check_chart_keys(values: dict[str, Any]) -> None:
    """A key the chart does not have is refused by its schema as `additional properties
    'model' not allowed` at a JSON pointer. Most often it is a trainer setting given without
    its `trainer.config.` prefix, or a typo; either is said here with the full path and the
    fix. Free-form maps (labels, resources, `nccl.env`) and `trainer.config` (the trainer's
    own check) are not walked."""
    _check_keys(values, json.loads(SCHEMA_FILE.read_text()), [])


def _check_keys(values: dict[str, Any], schema: dict[str, Any], path: list[str]) -> None:
    known = schema.get("properties", {})
    for key, value in values.items():
        where = ".".join([*path, key])
        if key in known:
            if isinstance(value, dict) and where != "trainer.config":
                _check_keys(value, known[key], [*path, key])
            continue
        if schema.get("additionalProperties") is not False:
            continue
        if not path and key in [field.name for field in dataclasses.fields(Config)]:
            raise ValuesError(
                f"{key}: not a chart value; trainer settings go under trainer.config.* "
                f"(--set trainer.config.{key}.…)"
            )
        if where.startswith("checkpoints.s3.") and re.search("secret|key|password|token", key, re.I):
            raise ValuesError(
                f"{where}: not a chart value; credentials go in a Secret, named by "
                "checkpoints.s3.existingSecret (or none, with IRSA), never in values"
            )
        siblings = {name: ".".join([*path, name]) for name in known}
        hint = did_you_mean(key, siblings)
        raise ValuesError(f"{where}: not a chart value; {hint}see helm/README.md for the chart's values")


def check_trainer_config(values: dict[str, Any]) -> None:
    """The trainer's own validation of `trainer.config` (the chart's defaults under
    `values`), before Helm renders: a typo or an out-of-range value is the trainer's line,
    did-you-mean included, and rules that JSON schema cannot say (one section's value
    against another's) hold at install, not when a pod starts."""
    defaults = yaml.safe_load(VALUES_FILE.read_text())["trainer"]["config"]
    given = (values.get("trainer") or {}).get("config") or {}
    try:
        from_tree(deep_merge(defaults, given))
    except ConfigError as error:
        raise ValuesError(f"trainer.config.{error}") from None


def render(
    values: dict[str, Any] | None = None, *, release: str = "ddp-run", namespace: str = "default"
) -> RenderedChart:
    """Render the chart for `release` in `namespace`; raises ValuesError for a trainer
    setting the trainer refuses and helm_python.HelmError with Helm's message for values the
    schema or a template refuses."""
    from helm_python import Chart, Config

    check_chart_keys(values or {})
    check_trainer_config(values or {})
    # one install id for both renders below (the chart would draw one in each); it starts with
    # a letter, as the chart's own do, so that `--set installId=<it>` stays a string
    install_id = (values or {}).get("installId") or f"i{secrets.token_hex(4)[:7]}"
    values = {**(values or {}), "installId": install_id}
    chart = Chart.load(CHART_DIR)
    result = Config().install(chart, release, values or {}, namespace=namespace, dry_run="client")
    manifest = pre_install_hooks(chart, values or {}, release, namespace) + result["manifest"]
    objects = [item for item in yaml.safe_load_all(manifest) if item]
    return RenderedChart(manifest=manifest, objects=objects, notes=result.get("notes", ""))


def pre_install_hooks(chart: Any, values: dict[str, Any], release: str, namespace: str) -> str:
    """The chart's pre-install hooks (a TrainJob's runtime), as `helm template` prints them
    and in the order Helm creates them: before the release's manifest, which leaves hooks
    out. What applies the objects in order (`ddp-ops submit`, k8s/) then meets them first."""
    from helm_python import Config

    documents = []
    rendered = Config().render(chart, values, name=release, namespace=namespace, is_install=True)
    for path, text in sorted(rendered.items()):
        if not path.endswith(".yaml"):  # NOTES.txt
            continue
        for document in re.split(r"^---\s*$", text, flags=re.MULTILINE):
            item = yaml.safe_load(document)
            hook = ((item or {}).get("metadata", {}).get("annotations") or {}).get("helm.sh/hook", "")
            if "pre-install" in hook.split(","):
                documents.append(f"---\n# Source: {path}\n{document.strip()}\n")
    return "".join(documents)


# ----- plain manifests in k8s/ and the chart's parameters table ----------------------------

ROOT = generated.ROOT
K8S_BASE = ROOT / "k8s" / "base"
K8S_REFERENCE = ROOT / "k8s" / "reference-values.yaml"
K8S_RELEASE, K8S_NAMESPACE = "ddp-run", "training"
README = CHART_DIR / "README.md"
VALUES_FILE, SCHEMA_FILE = CHART_DIR / "values.yaml", CHART_DIR / "values.schema.json"
NUMERIC = r"^[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?$"
TABLE_BEGIN, TABLE_END = "<!-- parameters:begin -->", "<!-- parameters:end -->"
GENERATED_HEADER = "# Generated from the chart by `python -m operator_scripts.chart write`; do not edit.\n"


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


K8S_TRAINJOB = ROOT / "k8s" / "overlays" / "trainjob"
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


def documented_keys(text: str) -> dict[str, tuple[str, str]]:
    """Dotted key -> (description, default) for each key of a values file preceded by a
    `# --` comment (the helm-docs convention); continuation comment lines join on."""
    found, stack, comment = {}, [], []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("# --"):
            comment = [stripped[4:].strip()]
            continue
        if stripped.startswith("#") and comment:
            comment.append(stripped[1:].strip())
            continue
        match = re.match(r"^(\s*)([A-Za-z][\w.-]*):\s*(.*)$", line)
        if not match:
            continue
        indent = len(match[1])
        stack = [(i, k) for i, k in stack if i < indent] + [(indent, match[2])]
        if comment:
            found[".".join(k for _, k in stack)] = (" ".join(comment), match[3] or "see values.yaml")
        comment = []
    return found


def parameters_table() -> str:
    """Markdown table of every documented key in values.yaml with its default."""
    rows = [
        f"| `{key}` | {description} | `{default}` |"
        for key, (description, default) in documented_keys((CHART_DIR / "values.yaml").read_text()).items()
    ]
    return "\n".join(["| key | description | default |", "| --- | --- | --- |", *rows])


def trainer_config_schema() -> dict[str, Any]:
    """The trainer's config as JSON schema, from its own pydantic models: sections inlined
    (Helm's validators differ on `$defs`), pydantic's generated titles dropped."""
    schema = TypeAdapter(Config).json_schema()
    definitions = schema.pop("$defs")

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(definitions[node["$ref"].rsplit("/", 1)[-1]])
            return {key: inline(value) for key, value in node.items() if key != "title"}
        if isinstance(node, list):
            return [inline(item) for item in node]
        return node

    return accept_set_strings(inline(schema))


def accept_set_strings(node: Any) -> Any:
    """Let a number also be a numeric string: Helm's `--set` parses integers and booleans
    but leaves `lr=0.001` a string, which the trainer reads as the number it is. The
    bounds then hold for numbers; for such strings, the render-time check and the pod's
    own check apply them."""
    if isinstance(node, list):
        return [accept_set_strings(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: accept_set_strings(value) for key, value in node.items()}
    if node.get("type") == "number":
        kept = {key: node.pop(key) for key in ("default", "description") if key in node}
        return {"anyOf": [node, {"type": "string", "pattern": NUMERIC}], **kept}
    return node


def schema_files() -> dict[Path, str]:
    """values.schema.json with `trainer.config` generated from the trainer's models."""
    schema = json.loads(SCHEMA_FILE.read_text())
    schema["properties"]["trainer"]["properties"]["config"] = {
        **trainer_config_schema(),
        "description": "The trainer's config tree (generated from trainer/config/schema.py).",
    }
    return {SCHEMA_FILE: json.dumps(schema, indent=2) + "\n"}


def docs_files() -> dict[Path, str]:
    text = README.read_text()
    before, _, rest = text.partition(TABLE_BEGIN)
    _, _, after = rest.partition(TABLE_END)
    return {README: f"{before}{TABLE_BEGIN}\n{parameters_table()}\n{TABLE_END}{after}"}


def main(argv: list[str] | None = None) -> int:
    return generated.main(
        argv,
        lambda: {**k8s_base_files(), **k8s_trainjob_files(), **docs_files(), **schema_files()},
        module="operator_scripts.chart",
        description="Regenerate or check k8s/, the chart parameters table and its trainer schema.",
        owned=lambda: sorted([*K8S_BASE.glob("*.yaml"), *K8S_TRAINJOB.glob("*.yaml")]),
    )


if __name__ == "__main__":
    raise SystemExit(main())
