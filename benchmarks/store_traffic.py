"""What a TCPStore serves, counted by the kernel rather than derived: the requests (data
segments) it received and the bytes it sent and received, summed over its connections.

A TCPStore client sends each request in one write and waits for its answer, so a request
is one data segment in (`data_segs_in` of `ss -ti`, over the server's established sockets)
while it fits one segment (64 KiB on loopback, a 1,500-byte MTU's 1,448 on a node's link:
a bigger request, a rendezvous state's, counts as several). Connections closed between two
readings drop out of the difference; a steady load keeps its connections.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

SERVER_THREAD = "pt_tcpstore_uv"
COUNTERS = re.compile(r"\b(bytes_sent|bytes_received|data_segs_in):(\d+)")


@dataclass(frozen=True)
class Traffic:
    requests: int
    bytes_in: int
    bytes_out: int
    connections: int

    def __sub__(self, before: Traffic) -> Traffic:
        return Traffic(
            self.requests - before.requests,
            self.bytes_in - before.bytes_in,
            self.bytes_out - before.bytes_out,
            self.connections,
        )


def served(port: int, namespace: str | None = None) -> Traffic:
    """The totals of the server listening on `port` (in network namespace `namespace`)."""
    command = ["ss", "-tinH", "state", "established", f"( sport = :{port} )"]
    if namespace is not None:
        command = ["ip", "netns", "exec", namespace, *command]
    listing = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    totals = {"bytes_sent": 0, "bytes_received": 0, "data_segs_in": 0}
    for name, value in COUNTERS.findall(listing):
        totals[name] += int(value)
    connections = sum(1 for line in listing.splitlines() if line and not line[0].isspace())
    return Traffic(totals["data_segs_in"], totals["bytes_received"], totals["bytes_sent"], connections)


def server_threads() -> set[int]:
    """This process's TCPStore server threads (libuv's loop is named `pt_tcpstore_uv`)."""
    found = set()
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            if (task / "comm").read_text().strip() == SERVER_THREAD:
                found.add(int(task.name))
    return found


def thread_cpu_seconds(thread: int) -> float:
    """The CPU-seconds thread `thread` of this process has run (utime + stime)."""
    fields = Path(f"/proc/self/task/{thread}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
