"""One line, one write: how processes that share a pipe keep their lines whole.

A pod's ranks, its watchdog and `ddp-launch` write to the same stdout and stderr. `print`
hands the text and its newline to the OS in two writes (CPython 3.11, seen with strace even
for 100 characters), so another process's line can land between them: two JSON records on
one line, which no log parser reads, and an empty line after. A single write of up to
PIPE_BUF bytes (4096 on Linux) is atomic on a pipe, so one write per line keeps it whole.
"""

from __future__ import annotations

import sys
from typing import TextIO


def write_line(text: str, stream: TextIO | None = None) -> None:
    """`text` and its newline in one write to `stream` (stderr by default), flushed."""
    stream = sys.stderr if stream is None else stream
    stream.write(text + "\n")
    stream.flush()
