"""A pod's process tree as a container runtime sees it: signalled whole, its orphans adopted
and reaped, its exit reported as a container's. Torch-free: `ddp-ops local` uses it too."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
from pathlib import Path

import psutil

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
CHILDREN_FILES = Path(f"/proc/self/task/{os.getpid()}/children").exists()


def container_exit_code(returncode: int) -> int:
    """A process's exit as a container's is reported: 128 + N when signal N ended it."""
    return 128 - returncode if returncode < 0 else returncode


def signal_tree(process: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signal a child process and all its descendants: torchrun starts its workers in
    sessions of their own, so signalling its process group alone would orphan them. A child
    already reaped is left alone: its pid may be another process's by now (pid_max is 32768
    by default, and a busy host goes through it in minutes; docs/facts.md, "A pod's
    processes"), whose tree would be signalled instead. One not yet reaped keeps its pid."""
    if process.poll() is not None:
        return
    try:
        tree = [psutil.Process(process.pid)]
        tree += tree[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for member in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.send_signal(sig)


def adopt_orphans() -> None:
    """Become the subreaper of everything started below (prctl PR_SET_CHILD_SUBREAPER):
    a process whose parent ends (the fork server, after the worker that started it; a
    writer whose worker was killed) is re-parented here, not to the host's init, so this
    pod's processes stay one tree, as a container's stay in its namespace. Where this
    runs as a container's PID 1 it has that role anyway."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def reap_orphans(keep: int) -> None:
    """Collect the exit status of adopted children that have ended, so that none stays a
    zombie; torchrun's (`keep`) is its Popen's to collect. A peek (WNOWAIT) at the next
    ended child, not psutil's scan of every process on the host five times a second."""
    while True:
        try:
            ended = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # no child at all
            return
        if ended is None or ended.si_pid == keep:  # the others wait until Popen has its own
            return
        with contextlib.suppress(ChildProcessError):
            os.waitpid(ended.si_pid, os.WNOHANG)


def has_children(pid: int) -> bool:
    """Whether `pid` has a child now, read from its threads' /proc/PID/task/TID/children:
    microseconds where psutil's `children()` reads the stat file of every process on the
    host. A kernel built without those files (CONFIG_PROC_CHILDREN) gets psutil's way."""
    if not CHILDREN_FILES:
        with contextlib.suppress(psutil.NoSuchProcess):
            return bool(psutil.Process(pid).children())
        return False
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return False
    for task in tasks:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a thread that ended
            if Path(f"/proc/{pid}/task/{task}/children").read_text().strip():
                return True
    return False
