"""SIGTERM and SIGINT: a preempted or deleted pod, or Ctrl-C on a laptop.

During training a signal only raises a flag; the ranks then agree, through a one-integer
all-reduce (MAX) that travels while a step computes, to stop together at one step boundary,
where rank 0 saves that step and waits for it to be published. The check runs every step
when steps are long, and at most every `min_interval_s` when they are short, so that it
costs well under 1% of the step time either way. Outside training (loading, testing) the
first signal ends the process at once; later ones are ignored, so that nothing cuts short
the wait for a write in flight.

torchrun forwards SIGTERM to its workers and SIGKILLs them `TORCH_ELASTIC_SHUTDOWN_TIMEOUT`
seconds later (30 by default; launcher/api.py:145-148, multiprocessing/api.py:1023-1052 in
torch 2.13): the save must be published before then.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import signal
import time
from types import FrameType

import torch
import torch.distributed as dist

from trainer.distributed.process_group import wait_for_peers
from trainer.telemetry.log import event
from trainer.termination_message import conclude

SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
SAFETY_MARGIN_S = 3.0
LEASE_LOST = 256  # not a signal: rank 0 found another run holding the checkpoint lease
EXIT_LEASE_LOST = 2  # permanent: a retry would be refused the lease


class Stopped(Exception):
    """Every rank stopped at a step boundary because one of them got `signum` (or LEASE_LOST)."""

    def __init__(self, signum: int) -> None:
        super().__init__("a lost checkpoint lease" if signum == LEASE_LOST else signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        """128 + the signal, as a container killed by it reports: retryable for the operator,
        and never 0, which would mark an elastic job Succeeded. A lost lease is permanent."""
        return EXIT_LEASE_LOST if self.signum == LEASE_LOST else 128 + self.signum


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignal:
    """The process's SIGTERM/SIGINT handler and the ranks' agreement on when to stop."""

    def __init__(self, min_interval_s: float = 0.02) -> None:
        self.signum: int | None = None
        self.detail = ""
        self.received_at = 0.0
        self.step = 0  # steps completed, as of the last poll
        self.received_during: int | None = None  # the step in progress when the signal came
        self.deferring = False
        self.min_interval_s = min_interval_s
        self.group: dist.ProcessGroup | None = None
        self.flag = torch.zeros(2, dtype=torch.int32)  # [signal, proposed check interval]
        self.pending: dist.Work | None = None
        self.next_check = 0
        self.started_at = 0

    def install(self) -> None:
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handle)
        atexit.register(self.uninstall)

    @staticmethod
    def uninstall() -> None:
        """Once the run is over, a signal ends the process as by default: raised in an exit
        callback (torch's library finalizers, tqdm's monitor, which registers after us and so
        runs before our own exit callback), SystemExit would print a traceback of a process
        that was ending anyway (seen when torchrun stopped a rank as it exited)."""
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            return  # already stopping: let the write in flight finish
        self.signum, self.received_at = signum, time.monotonic()
        self.received_during = self.step + 1
        if not self.deferring:
            raise SystemExit(128 + signum)

    def request(self, reason: int, detail: str) -> None:
        """Stop at the next agreed step for a reason of the trainer's own (LEASE_LOST),
        from any thread; `detail` is kept for the stop's line."""
        if self.signum is None:
            self.detail = detail
            self.signum, self.received_at = reason, time.monotonic()
            self.received_during = self.step + 1

    def start_training(self, device: torch.device) -> None:
        """From here on a signal is a request to stop at an agreed step. The flag travels
        on gloo on the CPU, so reading it never waits for a GPU."""
        if device.type == "cuda" and self.group is None:
            self.group = dist.new_group(backend="gloo")
        self.deferring = True  # a signal that came earlier already ended the process

    def stop_training(self) -> None:
        self.deferring = False
        if self.pending is not None:
            wait_for_peers(self.pending)
            self.pending = None

    def poll(self, step: int, step_seconds: float) -> None:
        """After each step: raise Stopped once every rank knows that one of them got a signal.

        A check started after one step is read after the next, so it overlaps with training.
        Its MAX carries each rank's proposed interval to the next check too: every rank reads
        the same values at the same step, so they start and read the same collectives."""
        self.step = step
        if self.pending is not None:
            wait_for_peers(self.pending)
            self.pending = None
            signum, interval = self.flag.tolist()
            if signum:
                raise Stopped(signum)
            self.next_check = self.started_at + max(1, interval)
        if step >= self.next_check:
            proposal = max(1, math.ceil(self.min_interval_s / max(step_seconds, 1e-6)))
            self.flag.copy_(torch.tensor([self.signum or 0, proposal], dtype=torch.int32))
            self.started_at = step
            self.pending = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def write_budget(self) -> float:
        """Seconds left for publishing the stop's checkpoint before torchrun's SIGKILL."""
        timeout = float(os.environ.get(SHUTDOWN_TIMEOUT_ENV, "30"))
        return max(0.0, timeout - (time.monotonic() - self.received_at) - SAFETY_MARGIN_S)


def report_stop(
    log: logging.Logger,
    stopped: Stopped,
    step: int,
    signal_step: int | None,
    *,
    published: bool,
    newest_step: int | None,
    location: str,
    elsewhere: str,
) -> None:
    """Rank 0's one line on a stop at `step`: saved at `location`, or NOT saved, why, and
    where the state is `elsewhere` (the snapshots). `signal_step` is the step during which
    this rank got the signal (None: a peer's)."""
    stopped_at = f"stopped by {stopped} at step {step}" + (
        f" (signal during step {signal_step})" if signal_step is not None else " (a peer's signal)"
    )
    if published and newest_step == step:
        event(log, "stopped", f"{stopped_at}: saved {location}", step=step, signal_step=signal_step)
        conclude(f"{stopped_at}: saved {location}")
    else:
        why = "its write failed" if published else "its write did not finish before the shutdown deadline"
        newest = f"the newest checkpoint is step {newest_step}; the newer state is {elsewhere}"
        line = f"{stopped_at}: NOT saved ({why}); {newest}"
        log.error(line)
        conclude(line)
