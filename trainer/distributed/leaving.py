"""A node's ranks that end on purpose say so to their launcher.

A node whose peer was lost ends its own ranks (the node watch) or each rank exits on the
lost peer's error: the trainer's own line says why. torchrun then reports the round's
exit as `failed (exitcode: 1)`, which read as a crash in the pod's log; `ddp-launch`
leaves that report out when it finds this note (trainer/launcher/torchrun_output.py)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

LEFT_FILE_ENV = "TRAINER_LEFT_FILE"  # set by ddp-launch


def mark_left(why: str) -> None:
    """Tell the launcher that this node's workers end on purpose, and why."""
    if LEFT_FILE_ENV in os.environ:
        with contextlib.suppress(OSError):
            Path(os.environ[LEFT_FILE_ENV]).write_text(why + "\n")
