"""`--set` overrides in Helm's syntax, so the chart and the CLI speak one language.

Supported, as in Helm's `strvals`: `a.b=c`, several pairs separated by commas, lists as
`{x,y}`, list elements as `a[0]=x`, backslash escapes for `, . = { } [ ]`, and Helm's
typing of scalars (`true`/`false`, `null`, integers without leading zeros; everything else
stays a string and the config schema converts it, so `optim.lr=3e-4` works). A test
checks agreement with Helm's own parser; one deliberate difference: `x={}` is an empty
list here, where Helm gives `[""]`.
"""

from __future__ import annotations

import re
from typing import Any

_INT = re.compile(r"^[-+]?(0|[1-9][0-9]*)$")
_INDEXED = re.compile(r"^(?P<name>.+)\[(?P<index>[0-9]+)\]$")


class OverrideError(ValueError):
    """A `--set` expression that cannot be parsed."""


def typed_scalar(text: str) -> Any:
    """Type a scalar the way `helm --set` does."""
    lowered = text.lower()
    if lowered == "true":
        return True
    if lowered == "false":
        return False
    if lowered == "null":
        return None
    if _INT.match(text):
        return int(text)
    return text


def _split_unescaped(text: str, separator: str) -> list[str]:
    """Split on `separator` outside `{...}` and not preceded by a backslash; keep escapes."""
    parts, current, depth, escaped = [], [], 0, False
    for char in text:
        if escaped:
            current.append("\\" + char)
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == "{":
            depth += 1
            current.append(char)
        elif char == "}":
            depth -= 1
            current.append(char)
        elif char == separator and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if escaped:
        current.append("\\")
    parts.append("".join(current))
    return parts


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text)


def _parse_value(raw: str) -> Any:
    if raw.startswith("{") and raw.endswith("}"):
        inner = raw[1:-1]
        if not inner:
            return []
        return [typed_scalar(_unescape(item)) for item in _split_unescaped(inner, ",")]
    return typed_scalar(_unescape(raw))


def _assign(tree: dict[str, Any], path: list[str], value: Any, expression: str) -> None:
    node: Any = tree
    for position, segment in enumerate(path):
        last = position == len(path) - 1
        match = _INDEXED.match(segment)
        key = _unescape(match["name"] if match else segment)
        if not key:
            raise OverrideError(f"--set {expression!r}: empty key segment")
        if not isinstance(node, dict):
            raise OverrideError(f"--set {expression!r}: {key!r} is set under a non-mapping value")
        if match is None:
            if last:
                node[key] = value
            else:
                node = node.setdefault(key, {})
            continue
        index = int(match["index"])
        items = node.setdefault(key, [])
        if not isinstance(items, list):
            raise OverrideError(f"--set {expression!r}: {key!r} is not a list")
        items.extend([None] * (index + 1 - len(items)))
        if last:
            items[index] = value
        else:
            if not isinstance(items[index], dict):
                items[index] = {}
            node = items[index]


def parse_set(expression: str, tree: dict[str, Any] | None = None) -> dict[str, Any]:
    """Apply one `--set` argument (possibly several comma-separated pairs) to `tree`."""
    tree = {} if tree is None else tree
    for pair in _split_unescaped(expression, ","):
        if not pair:
            continue
        key_value = _split_unescaped(pair, "=")
        if len(key_value) < 2:
            raise OverrideError(f"--set {pair!r}: expected key=value")
        key, raw = key_value[0], "=".join(key_value[1:])
        _assign(tree, _split_unescaped(key, "."), _parse_value(raw), pair)
    return tree


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Merge `update` into a copy of `base`; mappings merge key by key, anything else replaces."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged
