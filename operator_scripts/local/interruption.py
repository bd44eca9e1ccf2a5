"""The signals that end `ddp-ops local` early, handled as a job's deletion is: SIGTERM (what
`timeout`, CI runners, systemd and `kill` send), SIGINT (a terminal's Ctrl-C) and SIGHUP (a
terminal closing). The first asks the run to stop its pods as the kubelet ends a deleted
pod's containers (SIGTERM, the grace period, SIGKILL); one that comes while pods are
being stopped cuts their grace short."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Interruption:
    """What signals the run has had, counted by its handlers."""

    def __init__(self) -> None:
        self.received: list[int] = []

    @property
    def first(self) -> int | None:
        return self.received[0] if self.received else None

    def name(self) -> str:
        return signal.Signals(self.first).name if self.first else ""

    def since(self, count: int) -> bool:
        """Whether a signal came after the first `count` (a stop that began then hurries)."""
        return len(self.received) > count

    def _handle(self, signum: int, frame: object) -> None:
        self.received.append(signum)

    @contextlib.contextmanager
    def handled(self) -> Iterator[Interruption]:
        """Count the signals instead of dying of them, for the block."""
        previous = {sig: signal.signal(sig, self._handle) for sig in HANDLED}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
