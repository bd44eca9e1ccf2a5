"""An earlier local run's processes, found before any pod of this one starts. A pod's
processes end with the run that started them (`runtimes.sandbox`), but a run of an older
version, or one whose pods were started otherwise, may have left trees behind: still in
their rendezvous, frozen, holding CPU, memory and loopback ports. Each pod process's command
line holds its run's work folder (its hosts table, its volumes), and a leftover's tree has
no living run above it: every ancestor below init is such a process too."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import psutil

from operator_scripts.local.pods import LocalError

SHOWN = 3  # command lines named in the message


def _pod_path(workdir: Path) -> re.Pattern[str]:
    """A path inside this run's work folder or inside any default one (`ddp-local-*`)."""
    default = re.escape(tempfile.gettempdir()) + r"/ddp-local-[^/\s]+/"
    return re.compile(f"{re.escape(str(workdir.resolve()))}/|{default}")


def leftover_processes(workdir: Path) -> list[psutil.Process]:
    """Processes of a local run's pods whose run is gone."""
    pattern = _pod_path(workdir)
    found = {}
    for process in psutil.process_iter(["cmdline"]):
        if pattern.search(" ".join(process.info["cmdline"] or [])):
            found[process.pid] = process
    orphaned = []
    for process in found.values():
        try:
            ancestors = [parent.pid for parent in process.parents() if parent.pid != 1]
        except psutil.NoSuchProcess:
            continue
        if all(pid in found for pid in ancestors):
            orphaned.append(process)
    return sorted(orphaned, key=lambda process: process.pid)


def check_no_leftovers(workdir: Path) -> None:
    """One line naming an earlier run's processes and how to end them, before any pod of
    this run starts (they would hold its ports, or join its rendezvous)."""
    processes = leftover_processes(workdir)
    if not processes:
        return
    pids = " ".join(str(process.pid) for process in processes)
    shown = []
    for process in processes[:SHOWN]:
        try:
            shown.append(" ".join(process.cmdline())[:80])
        except psutil.NoSuchProcess:
            continue
    raise LocalError(
        f"an earlier local run left {len(processes)} processes of its pods running ({'; '.join(shown)}"
        f"{' ...' if len(processes) > SHOWN else ''}): end them with `kill -KILL {pids}` and run again"
    )
