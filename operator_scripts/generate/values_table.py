"""The chart's parameters table in helm/README.md, from the `# --` comments of values.yaml."""

from __future__ import annotations

import re
from pathlib import Path

from operator_scripts.paths import CHART_DIR

README = CHART_DIR / "README.md"
TABLE_BEGIN, TABLE_END = "<!-- parameters:begin -->", "<!-- parameters:end -->"


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


def docs_files() -> dict[Path, str]:
    text = README.read_text()
    before, _, rest = text.partition(TABLE_BEGIN)
    _, _, after = rest.partition(TABLE_END)
    return {README: f"{before}{TABLE_BEGIN}\n{parameters_table()}\n{TABLE_END}{after}"}
