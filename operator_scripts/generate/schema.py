"""values.schema.json's `trainer.config`, generated from the trainer's own pydantic models,
so that Helm refuses at install what the trainer would refuse at start."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from operator_scripts.chart.render import SCHEMA_FILE
from trainer.config import Config
from trainer.config.registry import DATASETS, MODELS, Registry

NUMERIC = r"^[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?$"
# package.module:function
PLUGIN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"


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

    config = accept_set_strings(inline(schema))
    for section, registry in (("data", DATASETS), ("model", MODELS)):
        field = config["properties"][section]["properties"]["name"]
        config["properties"][section]["properties"]["name"] = {**field, **registry_names(registry)}
    return config


def registry_names(registry: Registry) -> dict[str, Any]:
    """A name Helm can check without Python: a built-in one, or a plug-in's import path
    (whose module and function `ddp-ops` and the pod check)."""
    return {"anyOf": [{"enum": registry.names}, {"pattern": PLUGIN}]}


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
