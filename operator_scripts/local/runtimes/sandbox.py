"""Inside fresh UTS, mount and PID namespaces (made by `unshare`), give a local "pod" what a
real one has: its own host name, name resolution through the job's table of running pods,
and a process tree that ends whole.

`python -m operator_scripts.local.runtimes.sandbox HOSTNAME HOSTS_FILE NSSWITCH_FILE SHM_DIR -- COMMAND...`
sets the host name, bind-mounts the two files over /etc/hosts and /etc/nsswitch.conf and
the pod's shared-memory folder over /dev/shm (`-`: none), for this namespace only (the
host's files are untouched), and runs COMMAND. A pod's /dev/shm is its own, as the
chart's memory-backed emptyDir is: its snapshots are lost with the pod, not shared. With `hosts: files`
alone, a pod name that is not in the table fails to resolve at once, as a headless
Service's name does while its pod is not Ready; nothing is asked of the host's DNS.

This process is the namespace's PID 1, as a container's init (`docker run --init`) is: it
reaps whatever is orphaned in the pod and exits with COMMAND's status. When it ends, the
kernel kills every process left in its namespace, stopped ones included, which is how a
pod ends whole even when `ddp-ops local` is killed (`unshare --kill-child` gives this
process SIGKILL when `unshare` dies, and `setpriv --pdeathsig` gives `unshare` SIGKILL when
`ddp-ops local` dies; docs/facts.md, "A local pod's end"). Signals reach COMMAND directly:
the runtime signals every process of the pod, and a PID 1 drops those it has no handler for.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import socket
import sys

from trainer.launcher.process_tree import container_exit_code

MS_BIND = 4096


def bind_mount(source: str, target: str) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.mount(source.encode(), target.encode(), None, MS_BIND, None) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"bind mount {source} on {target}: {os.strerror(error)}")


def reap_until(child: int) -> int:
    """As PID 1: collect every process that ends here until `child` does; its exit as a
    container's (128 + N for signal N: a PID 1 cannot end itself by a signal)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Python's KeyboardInterrupt handler would take it
    while True:
        pid, status = os.wait()
        if pid == child:
            return container_exit_code(os.waitstatus_to_exitcode(status))


def main(argv: list[str]) -> None:
    hostname, hosts, nsswitch, shm, separator, *command = argv
    if separator != "--" or not command:
        raise SystemExit("usage: pod_sandbox HOSTNAME HOSTS NSSWITCH SHM_DIR -- COMMAND...")
    socket.sethostname(hostname)
    bind_mount(hosts, "/etc/hosts")
    bind_mount(nsswitch, "/etc/nsswitch.conf")
    if shm != "-":
        bind_mount(shm, "/dev/shm")
    sys.stdout.flush()
    child = os.fork()
    if child == 0:
        os.execvp(command[0], command)
    os._exit(reap_until(child))


if __name__ == "__main__":
    main(sys.argv[1:])
