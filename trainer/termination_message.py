"""The container's last word, where Kubernetes shows it: `kubectl describe pod`'s
"Message", the pod's `status.containerStatuses[].state.terminated.message`, `ddp-ops status`.

The kubelet reads the file at the container's `terminationMessagePath` when the container
ends, for any exit code, at most its last 4096 bytes; with `terminationMessagePolicy:
FallbackToLogsOnError`, a file left empty by a failed container gives way to the log's last
80 lines, at most 2048 bytes of them (docs/facts.md, "The kubelet"). So the process whose
verdict ends the container writes that one line there: `ddp-launch` in the chart's pods,
the trainer where it runs alone. The chart passes the path in MESSAGE_PATH_ENV; where it
is not set (a laptop) nothing is written.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

MESSAGE_PATH_ENV = "DDP_TERMINATION_MESSAGE_PATH"
MESSAGE_LIMIT = 4096  # the kubelet's MaxContainerTerminationMessageLength
# set by `ddp-launch`, which ends the container: where rank 0 leaves the run's last line
RESULT_FILE_ENV = "TRAINER_RESULT_FILE"


def write_termination_message(line: str) -> None:
    """`line`, cut to what the kubelet reads, as the container's termination message."""
    path = os.environ.get(MESSAGE_PATH_ENV)
    if not path:
        return
    data = line.strip().encode()[: MESSAGE_LIMIT - 1] + b"\n"
    with contextlib.suppress(OSError):  # a message unwritten costs the job nothing
        Path(path).write_bytes(data)


def conclude(line: str) -> None:
    """Rank 0's last line of the run (its summary, or where a stop left the state): to
    `ddp-launch`, whose verdict ends the container, or, run alone, the container's message."""
    if RESULT_FILE_ENV in os.environ:
        with contextlib.suppress(OSError):
            Path(os.environ[RESULT_FILE_ENV]).write_text(line.strip() + "\n")
    else:
        write_termination_message(line)
