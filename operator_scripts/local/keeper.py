"""A clean-up that outlives `ddp-ops local`: a process in a session of its own that waits
for the run to end and, when the run ended without saying it had cleaned up (a SIGKILL, the
kernel's OOM killer), runs the clean-up for it. The process runtime's pods need none (they
die with the run: `runtimes.sandbox`); the docker runtime's containers live in the engine,
which nothing tells when its client dies."""

from __future__ import annotations

import signal
import subprocess
import sys

DONE = b"done\n"


class Keeper:
    """Runs `argv` (with `env`) once this process is gone, unless `done()` was called first."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__, "--", *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # a terminal's or `timeout`'s signal to our group passes it by
        )

    def done(self) -> None:
        """The run cleaned up itself: the keeper leaves without doing anything."""
        self.process.stdin.write(DONE)
        self.process.stdin.close()
        self.process.wait(timeout=30)


def main(argv: list[str]) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    said = sys.stdin.buffer.read()  # returns when the run's end closes the pipe, however it ended
    if said != DONE:
        subprocess.run(argv[1:] if argv[:1] == ["--"] else argv, check=False)


if __name__ == "__main__":
    main(sys.argv[1:])
