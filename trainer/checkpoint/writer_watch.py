"""When a checkpoint writer with work is stuck, judged by the training process from the
writer's own reports (`writing.Progress`, its heartbeat every second, and each event).

A writer that says nothing at all is frozen (SIGSTOP, a paused node's process, a GIL held
in native code): past its silence limit it is stuck. One that keeps saying the same thing
is alive but makes no progress (a request the server never answers, a kernel wait): it is
stuck only past the longer stall limit, for botocore itself gives up on an unanswered
request after its read timeout and retries, which is progress. `CheckpointWriter` replaces
a stuck writer (writer.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from trainer.checkpoint.writing import Progress

WATCH_POLL_S = 1.0  # how often the training process looks
WRITER_MULTIPLE = 5.0  # times the longest silence seen between a working writer's reports
WRITER_START_S = 120.0  # a new writer's allowance to start (a new interpreter imports torch)
STALL_FLOOR_S = 90.0  # botocore's read timeout (60 s), then a margin: docs/facts.md, "botocore's timeouts"


@dataclass
class WriterWatch:
    """When a writer with work is stuck. Silent (no report at all: its process is frozen,
    stopped, or holds its GIL): after `WRITER_MULTIPLE` times the longest gap seen between
    its reports while it worked, at least `floor_s`, or a fixed `fixed_s`. Alive but making
    no progress (the same report again and again: a request the server never answers, a
    kernel wait): after that or STALL_FLOOR_S, whichever is longer, as botocore gives up on
    an unanswered request itself after its read timeout and retries."""

    floor_s: float
    fixed_s: float | None = None
    heard_at: float = 0.0
    progressed_at: float = 0.0
    longest_gap_s: float = 0.0
    working: bool = False
    last: Progress | None = None

    def limit(self) -> float:
        if self.fixed_s is not None:
            return self.fixed_s
        return max(self.floor_s, WRITER_MULTIPLE * self.longest_gap_s)

    def stall_limit(self) -> float:
        return max(self.limit(), STALL_FLOOR_S)

    def handed(self, now: float) -> None:
        """Work was handed over: an idle writer's clocks start now."""
        if not self.working:
            self.working, self.heard_at, self.progressed_at = True, now, now

    def expect_start(self, now: float) -> None:
        """A new writer is starting: it may be silent for WRITER_START_S more."""
        self.working, self.heard_at, self.progressed_at = True, now + WRITER_START_S, now + WRITER_START_S

    def heard(self, now: float, progress: Progress | None, still_working: bool) -> None:
        """A report: `progress` where it says where the work stands (None: an event that is
        progress by itself, a stage or a publish done)."""
        if self.working:  # a start's allowance (heard_at ahead of now) is no gap
            self.longest_gap_s = max(self.longest_gap_s, now - self.heard_at)
        if progress is None or progress != self.last:
            self.progressed_at = now
        self.last = progress or self.last
        self.heard_at, self.working = now, still_working

    def stuck(self, now: float) -> tuple[str, float, float] | None:
        """How the writer is stuck (its words, for how long, against what limit), or None."""
        if not self.working:
            return None
        if (silent := now - self.heard_at) > self.limit():
            return "silent", silent, self.limit()
        if (stalled := now - self.progressed_at) > self.stall_limit():
            return "alive but with no progress", stalled, self.stall_limit()
        return None


def doing(last: Progress | None) -> str:
    """What a stuck writer last said it was doing, for the line that names it."""
    if last is None:
        return ""
    total = f" of {last.total / 1e6:.1f} MB" if last.total else ""
    return f" ({last.phase}, {last.done / 1e6:.1f} MB{total} done, attempt {last.attempt})"


def abort_uploads(store: Any, steps: list[int], log: logging.Logger) -> None:
    """Abort the multipart uploads a stopped writer left open for `steps` (S3 keeps their
    parts, invisible); a store without them (local) has nothing to abort."""
    abort = getattr(store, "abort_uploads", None)
    for step in steps if abort else []:
        try:
            aborted = abort(step)
        except Exception as error:  # the store answers badly: its lifecycle rule cleans up
            log.warning("aborting step %d's open uploads failed: %s", step, error)
            continue
        if aborted:
            log.info("aborted %d open upload(s) of step %d", aborted, step)
