"""Inside a fresh UTS and mount namespace (made by `unshare`), give a local "pod" what a real
one has: its own host name, and name resolution through the job's table of running pods.

`python -m operator_scripts.local.runtimes.sandbox HOSTNAME HOSTS_FILE NSSWITCH_FILE SHM_DIR -- COMMAND...`
sets the host name, bind-mounts the two files over /etc/hosts and /etc/nsswitch.conf and
the pod's shared-memory folder over /dev/shm (`-`: none), for this namespace only (the
host's files are untouched), and execs COMMAND. A pod's /dev/shm is its own, as the
chart's memory-backed emptyDir is: its snapshots are lost with the pod, not shared. With `hosts: files`
alone, a pod name that is not in the table fails to resolve at once, as a headless
Service's name does while its pod is not Ready; nothing is asked of the host's DNS.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import socket
import sys

MS_BIND = 4096


def bind_mount(source: str, target: str) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.mount(source.encode(), target.encode(), None, MS_BIND, None) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"bind mount {source} on {target}: {os.strerror(error)}")


def main(argv: list[str]) -> None:
    hostname, hosts, nsswitch, shm, separator, *command = argv
    if separator != "--" or not command:
        raise SystemExit("usage: pod_sandbox HOSTNAME HOSTS NSSWITCH SHM_DIR -- COMMAND...")
    socket.sethostname(hostname)
    bind_mount(hosts, "/etc/hosts")
    bind_mount(nsswitch, "/etc/nsswitch.conf")
    if shm != "-":
        bind_mount(shm, "/dev/shm")
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
