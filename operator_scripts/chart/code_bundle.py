"""`--code DIR`: a small local package shipped with the job, for iterating without an image build.

The folder's files become the chart's `trainer.code` values: the chart puts them in one
ConfigMap (`<release>-ddp-trainer-code`), projects each key back to its path under
/opt/ddp-code, and puts that folder first on the pods' PYTHONPATH, so the trainer imports
the user's `package.module:function` plug-ins from there. A folder holding `__init__.py` is a
package and keeps its name (`--code ./my_models` gives `import my_models`); any other folder
is a path entry, its modules and packages at the top.

A ConfigMap holds at most 1 MiB: the API server's ValidateConfigMap (kubernetes
pkg/apis/core/validation/validation.go) sums the decoded length of every `data` and
`binaryData` value and refuses more than core.MaxSecretSize, 1048576 bytes. A larger folder
is refused here, in one line that says to build a derived image instead.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

CONFIGMAP_LIMIT = 1024 * 1024
SKIPPED_FOLDERS = {"__pycache__", "node_modules"}  # and every hidden one (.git, .venv, caches)
SKIPPED_SUFFIXES = {".pyc", ".pyo"}


class CodeError(ValueError):
    """A --code folder that cannot be shipped, in one line."""


def code_values(folder: Path) -> dict[str, Any]:
    """The chart values that ship `folder`: `{"trainer": {"code": [{path, data|binaryData}]}}`."""
    if not folder.is_dir():
        raise CodeError(f"--code {folder}: not a folder")
    root = folder.name if (folder / "__init__.py").is_file() else ""
    files, size = [], 0
    for path in sorted(_shipped(folder)):
        relative = path.relative_to(folder).as_posix()
        content = path.read_bytes()
        size += len(content)
        entry: dict[str, str] = {"path": f"{root}/{relative}" if root else relative}
        try:
            entry["data"] = content.decode()
        except UnicodeDecodeError:
            entry["binaryData"] = base64.b64encode(content).decode()
        files.append(entry)
    if not files:
        raise CodeError(f"--code {folder}: holds no files to ship")
    if size > CONFIGMAP_LIMIT:
        raise CodeError(
            f"--code {folder}: {size / 2**20:.2f} MiB, more than the 1 MiB a ConfigMap holds; "
            "build a derived image instead (README, 'Your own model and data')"
        )
    return {"trainer": {"code": files}}


def _shipped(folder: Path):
    for path in folder.iterdir():
        if path.name.startswith(".") or path.name in SKIPPED_FOLDERS:
            continue
        if path.is_dir():
            yield from _shipped(path)
        elif path.is_file() and path.suffix not in SKIPPED_SUFFIXES:
            yield path
