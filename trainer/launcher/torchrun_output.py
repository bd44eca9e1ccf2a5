"""torchrun's stderr (its workers' too) as `ddp-launch` passes it on: as it is, but for what
would bury the line that matters. Once the pod is stopping, torchrun's report of the signal
and its warnings about closing workers are left out (the trainer's line says what the stop
saved); once a worker has said a permanent error, only error lines follow."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import BinaryIO

from trainer.lines import write_line

ERROR_PREFIX = "trainer: error: "
TRACEBACK = b"Traceback (most recent call last):"
# what Python prints between the tracebacks of a chain of exceptions
# torchrun's report of a round whose workers exited (torch/distributed/elastic/multiprocessing/api.py)
WORKERS_FAILED = b"failed (exitcode: "
CHAINED = (b"During handling of the above exception", b"The above exception was the direct cause")


def relay(stream: BinaryIO, stopping: list[int], said: list[bytes], left: Path | None = None) -> None:
    """Copy torchrun's stderr (its workers' too) to ours. Once this pod is stopping, torchrun's
    own report of the signal, a traceback (or a chain of them) ending in SignalException, and
    its warnings about closing workers, are left out: the trainer's one line says what the
    stop saved. Once a worker has said a permanent error (this wrapper then kills torchrun),
    only error lines follow: the rest is the teardown's, such as a peer pod's store gone
    (c10d's warning and its C++ stack). Rank 0's error lines are noted in `said`. torchrun's
    `failed (exitcode: 1)` for workers that left on purpose (`left`, where a worker notes it,
    having said why in its own line) is left out: it is no crash."""
    held: list[bytes] = []
    between = False  # `held` ends with a traceback's last line: a chained one may follow
    failed = False
    for line in iter(stream.readline, b""):
        if line.startswith(ERROR_PREFIX.encode()):
            said.append(line)
        error = ERROR_PREFIX.encode() in line  # rank 0's, or another's with its rank's prefix
        if failed and not error:
            continue
        failed = failed or error
        if held and between:
            if line.startswith((TRACEBACK, *CHAINED)) or not line.strip():
                held.append(line)
                between = not line.startswith(TRACEBACK)
                continue
            _write_unless_signal(held)
            held, between = [], False
        if stopping and (held or line.startswith(TRACEBACK)):
            held.append(line)
            between = not line.startswith((b" ", TRACEBACK))  # a traceback's last line
            continue
        if stopping and (b"closing signal SIG" in line or b"death signal, shutting down" in line):
            continue
        if WORKERS_FAILED in line and left is not None and _take(left):
            continue
        sys.stderr.buffer.write(line)
        sys.stderr.buffer.flush()
    _write_unless_signal(held)


def _take(note: Path) -> bool:
    """Whether `note` was there; it is removed, so that the next failure is judged anew."""
    try:
        note.unlink()
    except FileNotFoundError:
        return False
    return True


def _write_unless_signal(traceback: list[bytes]) -> None:
    """A held traceback, unless it is the report of the signal this pod was stopped by."""
    if not any(b"SignalException" in line for line in traceback if not line.startswith(b" ")):
        sys.stderr.buffer.write(b"".join(traceback))
    sys.stderr.buffer.flush()


def fatal_line(fatal_file: Path) -> str:
    """The fatal error as rank 0 would have put it: one line, without the rank's prefix; ''
    where no worker reported one."""
    with contextlib.suppress(OSError):
        if line := fatal_file.read_text().strip():
            return ERROR_PREFIX + line.partition(ERROR_PREFIX)[2]
    return ""


def say_error(fatal_file: Path) -> None:
    if line := fatal_line(fatal_file):
        write_line(line)
