"""A crash that comes back the same way after a restart is a bug, not bad luck.

torchrun restarts its workers after any failure, and `ddp-launch` relaunches torchrun: right
for a lost peer or a flaky node, wrong for a bug that fails at the same step every time (a
plug-in's shape error past the first batch, a data sample that breaks the model). Each rank
notes how it crashed (step, phase, the error's first line) in a folder that outlives its
attempts (`ddp-launch` sets it, one per pod); a rank that crashes again at the same place
with the same error stops the job, as a configuration error does: one line, exit 2."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from trainer.config.plugin_errors import PluginIOError

# set by `ddp-launch`: where each rank notes its last crash, kept across torchrun's restarts
CRASH_DIR_ENV = "TRAINER_CRASH_DIR"


@dataclass(frozen=True)
class Crash:
    """Where and how a rank failed: its last step boundary, the phase it was in, the error."""

    step: int
    phase: str
    error: str

    @classmethod
    def of(cls, error: BaseException, step: int, phase: str) -> Crash:
        if isinstance(error, PluginIOError):  # the plug-in's own error, not its retry line
            return cls(step, phase, error.error)
        first_line = (str(error).strip().splitlines() or [""])[0]
        return cls(step, phase, f"{type(error).__name__}: {first_line}".rstrip(": "))


class RecurringCrash(Exception):
    """The same crash as in the attempt before: permanent."""

    def __init__(self, crash: Crash) -> None:
        super().__init__(
            f"the run failed at step {crash.step} ({crash.phase}) with {crash.error}, as in the attempt "
            "before this restart: a restart cannot fix it; fix the code or data, then start the job again"
        )


def check_recurrence(rank: int, crash: Crash) -> None:
    """Raise RecurringCrash if this rank crashed the same way last time, else note `crash`."""
    folder = os.environ.get(CRASH_DIR_ENV)
    if not folder:
        return
    record = Path(folder) / f"rank-{rank}.json"
    with contextlib.suppress(OSError, ValueError, TypeError):
        if Crash(**json.loads(record.read_text())) == crash:
            raise RecurringCrash(crash)
    with contextlib.suppress(OSError):
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps(asdict(crash)))
