"""A process told apart from a later one that got its pid.

Linux hands a dead process's pid to another after at most pid_max starts (32768 by default,
docs/facts.md): a pid kept in a file names whoever has it now. So beside the pid goes the
process's start (`/proc/PID/stat` field 22, clock ticks after boot), and a signal goes
through a pidfd, which pins the process while its start is compared."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path


def process_start(pid: int) -> int:
    """When process `pid` started, in clock ticks after boot; 0 where /proc cannot say (no
    such process, or no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    # the command name (field 2) is in parentheses and may hold spaces and parentheses
    return int(stat.rpartition(")")[2].split()[19])


def still_running(pid: int, started: int) -> bool:
    """Whether the process that had `pid` and started at `started` still runs; where /proc
    could not say when it was recorded (`started` 0), whether any process has the pid."""
    if started:
        return process_start(pid) == started
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def signal_process(pid: int, started: int, signum: int) -> bool:
    """Send `signum` to the process that had `pid` and started at `started`; False if it
    is gone, and never to another process that has the pid now."""
    if not hasattr(os, "pidfd_open"):  # not Linux: no /proc either, so the pid alone
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
            return True
        return False
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    try:
        if process_start(pid) != started:
            return False  # the pid is another process's now
        signal.pidfd_send_signal(pidfd, signum)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(pidfd)
