"""From YAML files and `--set` overrides to a validated `Config`, and back: every refusal is a
ConfigError naming the key, the value and what is allowed (pydantic's own errors, reworded)."""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import TypeAdapter, ValidationError

from trainer.config.overrides import OverrideError, deep_merge, parse_set
from trainer.config.schema import Config, ConfigError, did_you_mean

_ADAPTER = TypeAdapter(Config)


def bundled_config_names() -> list[str]:
    """Names accepted by `--config NAME`: the YAML files shipped in `trainer/configs`."""
    folder = resources.files("trainer") / "configs"
    return sorted(entry.name[:-5] for entry in folder.iterdir() if entry.name.endswith(".yaml"))


def _read_source(source: str) -> dict[str, Any]:
    path = Path(source)
    if path.is_file():
        text = path.read_text()
    elif source in bundled_config_names():
        text = (resources.files("trainer") / "configs" / f"{source}.yaml").read_text()
    else:
        allowed = ", ".join(bundled_config_names())
        raise ConfigError("--config", source, f"no such file; bundled configs are: {allowed}")
    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError as error:
        reason = str(error).replace("\n", " ")
        raise ConfigError("--config", source, f"not valid YAML ({reason})") from None
    if tree is None:
        raise ConfigError(
            "--config", source, "is empty; give it a section, or leave --config out for the defaults"
        )
    if not isinstance(tree, dict):
        raise ConfigError("--config", source, "must be a YAML mapping of sections")
    return tree


def _section_at(location: Sequence[Any]) -> type | None:
    """The dataclass that holds the key at `location`, for did-you-mean suggestions."""
    node: Any = Config
    for part in location[:-1]:
        hints = typing.get_type_hints(node)
        if part not in hints or not dataclasses.is_dataclass(hints[part]):
            return None
        node = hints[part]
    return node


def _field_path(location: Sequence[Any]) -> list[str]:
    """The config key an error is about: pydantic appends the member of a union it tried
    (`literal['auto']`, `int`) after a leaf field, which is not part of the key."""
    path: list[str] = []
    node: Any = Config
    for part in location:
        if not isinstance(part, str):
            continue
        if dataclasses.is_dataclass(node):
            path.append(part)
            node = typing.get_type_hints(node).get(part)
        elif typing.get_origin(node) is dict:  # free-form options: every key is the user's
            path.append(part)
        else:
            break
    return path


def _tuple_length(location: Sequence[str]) -> int:
    """How many items the tuple field at `location` holds."""
    section = _section_at(location)
    return len(typing.get_args(typing.get_type_hints(section)[location[-1]]))


def _error_from_pydantic(error: dict[str, Any], alternatives: Sequence[str] = ()) -> ConfigError:
    location = _field_path(error["loc"])
    key = ".".join(location)
    if error["type"] == "unexpected_keyword_argument":
        section = _section_at(location)
        names = [f.name for f in dataclasses.fields(section)] if section else []
        prefix = ".".join(location[:-1])
        qualified = [f"{prefix}.{name}" if prefix else name for name in names]
        hint = did_you_mean(location[-1], dict(zip(names, qualified, strict=True)))
        return ConfigError(key, error["input"], f"unknown key; {hint}allowed: {', '.join(qualified)}")
    if error["type"] == "missing" and location != list(error["loc"]):  # an item of a fixed-size tuple
        return ConfigError(key, error["input"], f"must be a list of {_tuple_length(location)} numbers")
    messages = dict.fromkeys([error["msg"], *alternatives])  # a union's members, each once
    allowed = " or ".join(messages).replace("Input should be", "must be")
    if error["type"] == "literal_error" and isinstance(error["input"], str):
        names = {repr(name): repr(name) for name in _literal_names(location)}
        allowed = did_you_mean(repr(error["input"]), names) + allowed
    return ConfigError(key, error["input"], allowed)


def _literal_names(location: Sequence[str]) -> list[str]:
    """The names a field allows: its Literal's, or those of the Literals in its union
    (`snapshot_every_steps: Literal["auto"] | int`)."""
    section = _section_at(location)
    hint = typing.get_type_hints(section)[location[-1]] if section else None
    members = typing.get_args(hint) if typing.get_origin(hint) is not Literal else (hint,)
    return [
        name
        for member in members
        if typing.get_origin(member) is Literal
        for name in typing.get_args(member)
        if isinstance(name, str)
    ]


def from_tree(tree: dict[str, Any]) -> Config:
    """Validate a plain tree into a Config, raising the first problem as a ConfigError."""
    try:
        config = _ADAPTER.validate_python(tree)
    except ValidationError as failure:
        first, *others = failure.errors()
        same_key = [e["msg"] for e in others if _field_path(e["loc"]) == _field_path(first["loc"])]
        raise _error_from_pydantic(first, same_key) from None
    _check_across_sections(config)
    return config


def _check_across_sections(config: Config) -> None:
    """Rules that tie one section's value to another's."""
    if config.ddp.comm_hook == "powersgd" and config.ddp.static_graph:
        raise ConfigError(
            "ddp.static_graph",
            True,
            "must be false with ddp.comm_hook=powersgd: its saved state is per DDP bucket, and a "
            "static graph re-buckets after the first step of every start",
        )
    drain, timeout = config.checkpoint.drain_timeout_s, config.dist.timeout_s
    if drain > timeout / 2:
        raise ConfigError(
            "checkpoint.drain_timeout_s",
            drain,
            f"must be at most half of dist.timeout_s ({timeout:g}s): the other ranks wait for the "
            "last write in a collective",
        )


def to_tree(config: Config) -> dict[str, Any]:
    """The config as plain YAML/JSON-friendly data (tuples become lists)."""
    return _ADAPTER.dump_python(config, mode="json")


def load_config(source: str | None, overrides: Sequence[str] = ()) -> Config:
    """Defaults, then the YAML file or bundled config, then each `--set` in order."""
    tree = _read_source(source) if source else {}
    for expression in overrides:
        try:
            tree = deep_merge(tree, parse_set(expression))
        except OverrideError as error:
            raise ConfigError("--set", expression, str(error)) from None
    config = from_tree(tree)
    if config.checkpoint.uri:
        return config
    uri = default_checkpoint_uri(source, config.model.name)
    return dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, uri=uri))


def default_checkpoint_uri(source: str | None, model: str) -> str:
    """`checkpoints/<config>-<model>`, where no `checkpoint.uri` is given: runs of another
    config or model do not meet in one folder, where the second would be refused. A
    plug-in's `package.module:function` keeps its dots; what is not a file name's becomes `.`."""
    config = "defaults" if source is None else Path(source).stem
    return f"checkpoints/{re.sub(r'[^A-Za-z0-9_.-]', '.', f'{config}-{model}')}"


def dump_yaml(config: Config) -> str:
    """The effective tree, as `--print-config` shows it."""
    return yaml.safe_dump(to_tree(config), sort_keys=False)
