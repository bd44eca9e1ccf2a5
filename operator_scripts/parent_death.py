"""A child that dies with the thread that started it, however that thread's process ends.

`setpriv --pdeathsig SIG --` sets the parent-death signal and execs the rest of the command
line, so the program it runs keeps its pid and the setting: the kernel sends SIG when the
thread that started it ends, by a SIGKILL too, and a `fork` child does not inherit it
(prctl(2), PR_SET_PDEATHSIG; docs/facts.md, "A local pod's end"). `ddp-ops local` starts
its pods, their namespaces' holders and its control-plane servers this way, and a private
dockerd, so that a killed run leaves none of them behind.
"""

from __future__ import annotations


def dies_with_parent(signal_name: str = "KILL") -> list[str]:
    """The command prefix that gives what follows `signal_name` when its parent thread ends."""
    return ["setpriv", "--pdeathsig", signal_name, "--"]
