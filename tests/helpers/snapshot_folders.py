"""Reading a run's snapshot folders while it writes and drops them."""

from __future__ import annotations

import os
from pathlib import Path


def snapshot_steps(folder: Path, *, complete: bool = False) -> list[int]:
    """The steps of the `step-N` folders anywhere under `folder` (with `complete`, only those
    whose manifest is written). A folder removed while it is listed (a snapshot replaced, all
    of them dropped at the run's end) is left out: os.walk skips what it cannot list, where
    Path.rglob raises FileNotFoundError (Python 3.11, pathlib._RecursiveWildcardSelector)."""
    steps = []
    for parent, folders, _ in os.walk(folder):
        for name in folders:
            is_step = name.startswith("step-") and name[5:].isdigit()
            if is_step and (not complete or (Path(parent) / name / "manifest.json").exists()):
                steps.append(int(name[5:]))
    return sorted(steps)
