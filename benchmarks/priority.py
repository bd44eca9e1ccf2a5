"""The lowest CPU priority Linux has, for the stand-ins of remote servers (moto's S3, the
fault proxy): a real endpoint is another machine's CPU. Each stand-in takes it itself, after
its imports: started at that priority on a busy machine, moto's imports alone outlasted a
30 s start-up deadline (seen in CI beside the test suite)."""

from __future__ import annotations

import os


def lowest_priority() -> None:
    """SCHED_IDLE where the kernel has it, else nice 19; threads started later inherit it."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)
