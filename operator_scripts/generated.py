"""Files generated from code (dashboards, rules, plain manifests, docs tables): written on
request, and checked for drift so that what is committed is what the code produces."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def stale(files: dict[Path, str]) -> list[Path]:
    """Files missing or different from what the generator produces."""
    return [path for path, text in files.items() if not path.is_file() or path.read_text() != text]


def main(
    argv: Sequence[str] | None,
    generate: Callable[[], dict[Path, str]],
    *,
    module: str,
    description: str,
    owned: Callable[[], list[Path]] = list,
) -> int:
    """`write` regenerates the files (removing `owned` ones no longer produced); `check`
    exits 1 naming each stale file."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("action", choices=["write", "check"])
    args = parser.parse_args(argv)
    files = generate()
    if args.action == "check":
        for path in stale(files):
            print(f"stale: {path.relative_to(ROOT)}; run python -m {module} write", file=sys.stderr)
        return 1 if stale(files) else 0
    for path in owned():
        if path not in files:
            path.unlink()
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")
    return 0
