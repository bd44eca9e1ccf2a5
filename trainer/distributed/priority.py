"""Lowering a helper process's CPU priority, so that it takes only idle cycles.

`os.nice` alone is not enough where the kernel groups tasks by session (autogroup,
CONFIG_SCHED_AUTOGROUP, on in most distributions' kernels): the scheduler first shares the
CPU between the sessions' groups, and a nice value ranks threads within one group only
(sched(7), "The autogroup feature"). The helpers here (a checkpoint writer, a fork server's
imports) each run in a session of their own, so their group's nice value is raised too,
through /proc/self/autogroup, which any process may do for its own group.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

AUTOGROUP = Path("/proc/self/autogroup")


def lower_priority(niceness: int) -> None:
    """This process's nice value and, where there is one, its session's group's."""
    os.nice(niceness)
    lower_session_priority(niceness)


def lower_session_priority(niceness: int) -> None:
    """The nice value of this session's group alone: a process forked from here that
    starts a session of its own leaves it, and keeps the priority of the thread it
    was forked from."""
    with contextlib.suppress(OSError):
        AUTOGROUP.write_text(str(niceness))


def lower_thread_priority(niceness: int) -> None:
    """The calling thread's nice value alone (Linux's nice is per thread)."""
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
