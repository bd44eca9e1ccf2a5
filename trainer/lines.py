"""One line, one write: how processes that share a pipe keep their lines whole.

A pod's ranks, its watchdog and `ddp-launch` write to the same stdout and stderr. `print`
hands the text and its newline to the OS in two writes (CPython 3.11, seen with strace even
for 100 characters), so another process's line can land between them: two JSON records on
one line, which no log parser reads, and an empty line after. A single write of up to
PIPE_BUF bytes (4096 on Linux) is atomic on a pipe, so one write per line keeps it whole.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path
from typing import TextIO


def write_line(text: str, stream: TextIO | None = None) -> None:
    """`text` and its newline in one write to `stream` (stderr by default), flushed."""
    stream = sys.stderr if stream is None else stream
    stream.write(text + "\n")
    stream.flush()


def first_to_say(text: str, defer_s: float = 0.0) -> bool:
    """Whether no other worker of this torchrun attempt has said `text` yet, after letting
    the one that should say it (the node's first rank) go first for `defer_s`. The ranks of a
    node that meet the same error (a config, a plug-in) say it once between them, where a
    line per rank repeated it. The marker lies in torchrun's folder for this attempt, the
    parent of each worker's TORCHELASTIC_ERROR_FILE (`attempt_N/LOCAL_RANK/error.json`,
    torch/distributed/elastic/multiprocessing/api.py:313-390 in torch 2.13), which is new for
    each torchrun and each restart; without one (a lone process) every line is said."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return True
    time.sleep(defer_s)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    try:
        (Path(error_file).parents[1] / f"said-{digest}").touch(exist_ok=False)
    except FileExistsError:
        return False
    except OSError:  # the folder is gone or read-only: better said twice than never
        pass
    return True


def last_line(output: str, default: str) -> str:
    """The last line a failed tool printed (usually its reason), for a one-line error."""
    return (output.strip().splitlines() or [default])[-1]
