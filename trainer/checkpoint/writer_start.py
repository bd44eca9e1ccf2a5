"""Starting a node's checkpoint writer process: forked where that is safe, else a new
interpreter.

The writer needs torch (it serializes the state), and a new interpreter importing it costs
about 3 s of CPU, on every run and every restart of a writing rank: a two-rank digits run of
20 steps on 2 cores took 20.2 CPU-seconds with it, 17.5 with a forked writer (the means of 3
interleaved pairs, the whole machine's CPU counted). A fork of the training
process, which has imported everything already, costs milliseconds. A fork copies only the
calling thread, so it is taken only while the process runs no other thread (a lock that
another thread held would stay locked in the child): `train` starts the writer first, before
the run's threads. Where threads run already (a worker forked by the fork server watches its
client on one; a writer started late), the writer starts as a new interpreter, as before.
Either way the writer is the same program (`writer_process.run`), in a session of its own
(a Ctrl-C to the terminal's group is for the trainer), at a lower CPU priority.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import BinaryIO, Protocol

from trainer.checkpoint.writer_process import WRITER_NICENESS
from trainer.checkpoint.writer_process import run as run_writer

# not `-m`: the package already imports the module, and runpy would run a second copy
WRITER_MAIN = (
    f"import os; os.nice({WRITER_NICENESS}); "
    "from trainer.checkpoint.writer_process import main; raise SystemExit(main())"
)


class WriterHandle(Protocol):
    """What the training process holds of its writer: the pipe it sends on, the pipe it
    hears on, and the wait for its exit code (negative: the signal that killed it)."""

    pid: int
    stdin: BinaryIO
    stdout: BinaryIO

    def wait(self) -> int: ...


@dataclass
class ForkedWriter:
    """A writer forked from this process."""

    pid: int
    stdin: BinaryIO
    stdout: BinaryIO
    returncode: int | None = None

    def wait(self) -> int:
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def spawn_writer() -> WriterHandle:
    """Start a writer process; it waits for its setup on its stdin."""
    if threading.active_count() == 1:
        return _fork_writer()
    return subprocess.Popen(
        [sys.executable, "-c", WRITER_MAIN],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )


def _fork_writer() -> ForkedWriter:
    """The child talks on pipes of its own and keeps the trainer's stderr, as a new
    interpreter would: its stdout is pointed there too (a warning it logs reads as the
    trainer's), so that a reader of the trainer's stdout is not kept waiting for the end of
    a writer that outlives it. Buffered output is flushed first, so that neither process
    writes it twice."""
    inbox_read, inbox_write = os.pipe()
    outbox_read, outbox_write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the writer: never returns into the trainer's code, nor runs its exit hooks
        code = 1
        try:
            os.setsid()
            os.nice(WRITER_NICENESS)
            os.dup2(2, 1)
            os.close(inbox_write)
            os.close(outbox_read)
            code = run_writer(os.fdopen(inbox_read, "rb"), os.fdopen(outbox_write, "wb"))
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    os.close(inbox_read)
    os.close(outbox_write)
    return ForkedWriter(pid, os.fdopen(inbox_write, "wb"), os.fdopen(outbox_read, "rb"))
