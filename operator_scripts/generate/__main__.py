"""`python -m operator_scripts.generate write|check`: rewrite every generated file, or exit 1
naming each one that differs from what the code produces."""

from __future__ import annotations

import argparse
import sys

from operator_scripts.generate.catalog import generated_files, owned_files
from operator_scripts.generate.files import stale, write
from operator_scripts.paths import REPO


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m operator_scripts.generate", description=__doc__)
    parser.add_argument("action", choices=["write", "check"])
    args = parser.parse_args(argv)
    files = generated_files()
    if args.action == "check":
        drifted = stale(files)
        for path in drifted:
            print(
                f"stale: {path.relative_to(REPO)}; run python -m operator_scripts.generate write",
                file=sys.stderr,
            )
        return 1 if drifted else 0
    write(files, owned=owned_files())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
