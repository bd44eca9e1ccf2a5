"""Writing generated files, and finding those that drifted from what the code produces."""

from __future__ import annotations

from pathlib import Path

from operator_scripts.paths import REPO


def stale(files: dict[Path, str]) -> list[Path]:
    """Files missing or different from what the generator produces."""
    return [path for path, text in files.items() if not path.is_file() or path.read_text() != text]


def write(files: dict[Path, str], owned: list[Path]) -> None:
    """Write `files`, and remove each `owned` file no longer produced."""
    for path in owned:
        if path not in files:
            path.unlink()
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(REPO)}")
