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

from operator_scripts.chart.plugin_source import check_plugin_source
from operator_scripts.chart.state_size import derived_state_size
from operator_scripts.paths import CHART_DIR
from trainer.config import Config, ConfigError, did_you_mean, from_tree
from trainer.config.overrides import deep_merge
from trainer.config.registry import DATASETS, MODELS

VALUES_FILE, SCHEMA_FILE = CHART_DIR / "values.yaml", CHART_DIR / "values.schema.json"


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
        if re.match(r"checkpoints?\.s3\.", where) and re.search("secret|key|password|token", key, re.I):
            raise ValuesError(
                f"{where}: not a chart value; credentials go in a Secret, named by "
                f"{path[0]}.s3.existingSecret (or none, with IRSA), never in values"
            )
        siblings = {name: ".".join([*path, name]) for name in known}
        hint = did_you_mean(key, siblings)
        raise ValuesError(f"{where}: not a chart value; {hint}see helm/README.md for the chart's values")


def check_trainer_config(values: dict[str, Any], chart_values: dict[str, Any]) -> Config:
    """The trainer's own validation of `trainer.config` (the chart's defaults under
    `values`), before Helm renders: a typo or an out-of-range value is the trainer's line,
    did-you-mean included, and rules that JSON schema cannot say (one section's value
    against another's) hold at install, not when a pod starts. So do the model and dataset
    names: a built-in's is known here without torch; a plug-in's (`package.module:function`)
    module and function are looked for in its source, shipped with the job (`--code`) or
    found by this Python, without running it (`plugin_source`); one in the image alone is
    checked in the pod. `chart_values` is the chart's values.yaml. Returns the config the
    pods will read."""
    defaults = chart_values["trainer"]["config"]
    trainer = values.get("trainer") or {}
    given = trainer.get("config") or {}
    try:
        config = from_tree(deep_merge(defaults, given))
        for registry, name in ((DATASETS, config.data.name), (MODELS, config.model.name)):
            if registry.is_plugin(name):
                check_plugin_source(registry, name, trainer.get("code") or [])
            else:
                registry.check(name)
    except ConfigError as error:
        raise ValuesError(f"trainer.config.{error}") from None
    return config


def with_state_size(values: dict[str, Any], config: Config, chart_values: dict[str, Any]) -> dict[str, Any]:
    """`values` with `snapshots.stateSize` the model's own where they leave it unset and it
    can be known here (`state_size`)."""
    if "stateSize" in (values.get("snapshots") or {}):
        return values
    size = derived_state_size(config, deep_merge(chart_values, values))
    return values if size is None else deep_merge(values, {"snapshots": {"stateSize": size}})


def render(
    values: dict[str, Any] | None = None, *, release: str = "ddp-run", namespace: str = "default"
) -> RenderedChart:
    """Render the chart for `release` in `namespace`; raises ValuesError for a trainer
    setting the trainer refuses and helm_python.HelmError with Helm's message for values the
    schema or a template refuses."""
    from helm_python import Chart, Config

    values = values or {}
    check_chart_keys(values)
    chart_values = yaml.safe_load(VALUES_FILE.read_text())
    values = with_state_size(values, check_trainer_config(values, chart_values), chart_values)
    # one install id for both renders below (the chart would draw one in each); it starts with
    # a letter, as the chart's own do, so that `--set installId=<it>` stays a string
    install_id = values.get("installId") or f"i{secrets.token_hex(4)[:7]}"
    values = {**values, "installId": install_id}
    chart = Chart.load(CHART_DIR)
    result = Config().install(chart, release, values, namespace=namespace, dry_run="client")
    manifest = pre_install_hooks(chart, values, release, namespace) + result["manifest"]
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
